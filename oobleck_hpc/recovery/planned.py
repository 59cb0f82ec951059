"""Planned changes at a step boundary, the driver's other path besides failures: a drain
(control/drain.py) and a straggler's re-plan (recovery/straggler.py), functions of the driver's
state (recovery/state.py) that `ElasticDriver.step` calls after a commit.
Both are decided from the commit vote every rank took part in, so every rank acts after the same
committed step: the leaving nodes' ranks raise `Drained`, the others reconfigure without them
(the recovery rounds, nothing replayed), or every rank switches to a new batch split in place.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.errors import EXIT_OK, OobleckError
from oobleck_hpc.recovery.generation import on_phase, round_opened, teardown
from oobleck_hpc.recovery.rounds import Recovery, run_rounds

if TYPE_CHECKING:
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.recovery.state import DriverState


class Drained(OobleckError):
    """This node leaves at a step boundary, on purpose (`leave`: its drain was
    accepted, or it was excluded as a straggler), with nothing lost (train.py exits 0).
    `bye`: its agent says BYE (else the survivors' round removes it: membership.py, 4e)."""

    exit_code = EXIT_OK

    def __init__(self, message: str, bye: bool = True):
        super().__init__(message)
        self.bye = bye


def drain(s: DriverState, drains: dict[str, bool]) -> None:
    """A committed step's vote carried drain requests (control/drain.py, step 3): every rank
    reaches the same verdict. Accepted: the leaving nodes' ranks raise Drained (train.py
    lets the node go), the others reconfigure without them from the step just committed
    (the recovery rounds, nothing replayed). Refused: `drain_refused`, and the job goes on
    with the node -- or, forced, `s.stop_for` tells train.py to stop with a checkpoint
    of this step for a requeue without the node."""
    from oobleck_hpc.control.drain import consume_request, verdict
    from oobleck_hpc.planning.cost import job_profile

    v = verdict(s.plan, list(drains), any(drains.values()), s.templates,
                job_profile(s.job, s.profile), s.job.fault_tolerance.f, s.view)
    step = s.engine.state.step
    if s.rank == 0 or s.node in v.leaving:  # (the leaving nodes' ranks tell it first)
        s.events.emit("drain_agreed" if v.accepted else "drain_refused",
                      nodes=list(v.leaving), step=step, force=v.force, reason=v.reason,
                      plan=v.plan.digest() if v.accepted else None)
    if s.node in v.leaving and s.local_rank == 0 and s.events.path is not None:
        consume_request(s.events.path.parent, s.node)
    if not v.accepted:
        if s.node in v.leaving:
            s.client.drain_request = None  # answered: not voted again
        if v.force:
            s.stop_for = v
        return
    leave(s, v.leaving, "drained", v.plan)


def leave(s: DriverState, leaving: tuple[str, ...], why: str, plan: Plan) -> None:
    """`leaving` go at this step boundary, on purpose (a drain, an excluded straggler): their
    ranks raise Drained, the others reconfigure without them from the step just committed
    (the recovery rounds; nothing is replayed). `plan`: the plan without them, already
    computed for the verdict (`planned`: the round's replan takes it as it is)."""
    step = s.engine.state.step
    s.planned = ((s.plan.digest(), tuple(n for n in s.plan.nodes if n in leaving)), plan)
    # The survivors open the round that removes them, right after the vote (membership.py,
    # 4e) -- unless the view's coordinator leaves, whose values of the vote the others' round
    # could overtake. Then the leaving nodes say BYE once every member holds the vote's result
    # (this exchange): a BYE ahead of it would fail a peer's vote (settled in a recovery:
    # rolled forward, a failed step in the record).
    bye = s.view[0] in leaving
    if bye:
        try:
            s.client.exchange(f"leave-{step}", [], timeout=s.agree_s, gen=s.gen)
        except (Superseded, TimeoutError):
            pass  # a round opened meanwhile: its reconcile settles what the vote left open
    elif s.node not in leaving:
        s.client.drain_out(leaving)
    if s.node in leaving:
        raise Drained(f"node {s.node} {why} after step {step}", bye=bye)
    engine, s.engine = s.engine, None
    s.base, s.base_plan = engine, s.plan
    teardown(s)
    s.pending = Recovery(step + 1, (), s.gen, "", time.time(), drained=leaving)
    run_rounds(s, s.pending, None, why)


def straggle(s: DriverState, compute: dict[int, float], seconds: float) -> None:
    """After a committed step: track each node's slowdown from the vote's compute figures;
    a node found slow (or recovered) gets the action the planner predicts best
    (recovery/straggler.py), the same on every rank. `seconds`: the step's time (the vote's:
    the longest any rank took, the same figure everywhere)."""
    from oobleck_hpc.recovery.straggler import Choice, choose, ratios
    from oobleck_hpc.planning.cost import job_profile, predicted_step_ms
    from oobleck_hpc.planning.instantiate import resplit

    ft = s.job.fault_tolerance
    s.step_s.append(seconds)
    w = s.watching
    if w is not None and len(s.step_s) >= ft.straggler_steps:
        if s.rank == 0:
            s.events.emit("straggler_measured", node=w[0].node, action=w[0].action,
                          predicted_ms=w[0].predicted_ms[w[0].action],
                          before_s=round(w[1], 4),
                          after_s=round(statistics.median(s.step_s), 4))
        s.watching = None
    if s.plan.digest() != s.tracked:  # a new plan: its first step is not counted
        s.tracked = s.plan.digest()
        s.stragglers.restart()
        return
    found, recovered = s.stragglers.observe(ratios(s.plan, compute), seconds)
    if not found and not recovered:
        return  # (the common case: no planner work after a step)
    profile = job_profile(s.job, s.profile)
    if found:
        node = max(found, key=found.get)
        c = choose(s.plan, profile, s.templates, ft.f, node, found[node], s.view, ft.straggler)
    elif s.plan.digest() != resplit(s.plan, profile, {}).digest():  # (recovered)
        back = resplit(s.plan, profile, s.stragglers.slow)
        c = Choice(recovered[0], 1.0, "restore",
                   {"restore": round(predicted_step_ms(back, profile), 3)}, back)
    else:
        return
    if s.rank == 0 or c.node == s.node:
        s.events.emit("straggler", node=c.node, slowdown=c.slowdown, action=c.action,
                      predicted_ms=c.predicted_ms, step=s.engine.state.step,
                      plan=c.plan.digest() if c.plan is not None else None)
    if c.action == "keep":
        return
    s.watching = (c, statistics.median(s.step_s) if s.step_s else 0.0)
    s.step_s.clear()
    if c.action == "exclude":
        leave(s, (c.node,), "excluded as a straggler", c.plan)
    else:
        switch(s, replace(c.plan, generation=s.gen))


def switch(s: DriverState, plan: Plan) -> None:
    """Every rank moves to `plan`, the same layout with another batch split, after the same
    committed step: a new engine on the same groups adopts every layer (nothing moves);
    the old one stays the base until the new plan's first commit (driver.py, `committed`)."""
    from oobleck_hpc.engine import Engine

    old = s.engine
    old.release_step_memory()  # first: it drops the gradient views the new engine makes
    s.engine = Engine(s.job, s.model, plan, s.comm, old.groups, s.dataset, s.device,
                      state=replace(old.state), on_phase=partial(on_phase, s),
                      abort=partial(round_opened, s), adopt=old)
    s.base, s.base_plan, s.plan = old, s.plan, plan

