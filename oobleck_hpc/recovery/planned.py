"""Planned changes at a step boundary, the driver's other path besides failures (`ElasticDriver`
is a `PlannedChanges`): a drain (control/drain.py) and a straggler's re-plan (recovery/straggler.py).
Both are decided from the commit vote every rank took part in, so every rank acts after the same
committed step: the leaving nodes' ranks raise `Drained`, the others reconfigure without them
(the recovery rounds, nothing replayed), or every rank switches to a new batch split in place.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.recovery.rounds import Recovery
from oobleck_hpc.errors import EXIT_OK, OobleckError


class Drained(OobleckError):
    """This node leaves at a step boundary, on purpose (`ElasticDriver._leave`: its drain was
    accepted, or it was excluded as a straggler), with nothing lost (train.py exits 0)."""

    exit_code = EXIT_OK


class PlannedChanges:
    """The planned-change phases of `ElasticDriver` (module docstring)."""

    def _drain(self, drains: dict[str, bool]) -> None:
        """A committed step's vote carried drain requests (control/drain.py, step 3): every rank
        reaches the same verdict. Accepted: the leaving nodes' ranks raise Drained (train.py
        lets the node go), the others reconfigure without them from the step just committed
        (the recovery rounds, nothing replayed). Refused: `drain_refused`, and the job goes on
        with the node -- or, forced, `self.stop_for` tells train.py to stop with a checkpoint
        of this step for a requeue without the node."""
        from oobleck_hpc.control.drain import consume_request, verdict
        from oobleck_hpc.planning.cost import job_profile

        v = verdict(self.plan, list(drains), any(drains.values()), self.templates,
                    job_profile(self.job, self.profile), self.job.fault_tolerance.f,
                    self.view)
        step = self.engine.state.step
        if self.rank == 0 or self.node in v.leaving:  # (the leaving nodes' ranks tell it first)
            self.events.emit("drain_agreed" if v.accepted else "drain_refused",
                             nodes=list(v.leaving), step=step, force=v.force, reason=v.reason,
                             plan=v.plan.digest() if v.accepted else None)
        if self.node in v.leaving and self.local_rank == 0 and self.events.path is not None:
            consume_request(self.events.path.parent, self.node)
        if not v.accepted:
            if self.node in v.leaving:
                self.client.drain_request = None  # answered: not voted again
            if v.force:
                self.stop_for = v
            return
        self._leave(v.leaving, "drained", v.plan)

    def _leave(self, leaving: tuple[str, ...], why: str, plan) -> None:
        """`leaving` go at this step boundary, on purpose (a drain, an excluded straggler): their
        ranks raise Drained, the others reconfigure without them from the step just committed
        (the recovery rounds; nothing is replayed). `plan`: the plan without them, already
        computed for the verdict (`planned`: the round's replan takes it as it is)."""
        step = self.engine.state.step
        self.planned = ((self.plan.digest(), tuple(n for n in self.plan.nodes if n in leaving)),
                        plan)
        try:
            # Once this exchange completes, every member holds the vote's result: the leaving
            # nodes' BYE can no longer overtake it and fail a peer's vote (it then settles the
            # step in a recovery: rolled forward, a failed step in the record).
            self.client.exchange(f"leave-{step}", [], timeout=self.agree_s, gen=self.gen)
        except (Superseded, TimeoutError):
            pass  # a round opened meanwhile: its reconcile settles what the vote left open
        if self.node in leaving:
            raise Drained(f"node {self.node} {why} after step {step}")
        engine, self.engine = self.engine, None
        self.base, self.base_plan = engine, self.plan
        self._teardown()
        self._pending = Recovery(step + 1, (), self.gen, "", time.time(), drained=leaving)
        self.rounds(self._pending, None, why)

    def _straggle(self, compute: dict[int, float], seconds: float) -> None:
        """After a committed step: track each node's slowdown from the vote's compute figures;
        a node found slow (or recovered) gets the action the planner predicts best
        (recovery/straggler.py), the same on every rank. `seconds`: the step's time (the vote's:
        the longest any rank took, the same figure everywhere)."""
        from oobleck_hpc.recovery.straggler import Choice, choose, ratios
        from oobleck_hpc.planning.cost import job_profile, predicted_step_ms
        from oobleck_hpc.planning.instantiate import resplit

        ft = self.job.fault_tolerance
        self._step_s.append(seconds)
        w = self._watching
        if w is not None and len(self._step_s) >= ft.straggler_steps:
            if self.rank == 0:
                self.events.emit("straggler_measured", node=w[0].node, action=w[0].action,
                                 predicted_ms=w[0].predicted_ms[w[0].action],
                                 before_s=round(w[1], 4),
                                 after_s=round(statistics.median(self._step_s), 4))
            self._watching = None
        if self.plan.digest() != self._tracked:  # a new plan: its first step is not counted
            self._tracked = self.plan.digest()
            self.stragglers.restart()
            return
        found, recovered = self.stragglers.observe(ratios(self.plan, compute), seconds)
        if not found and not recovered:
            return  # (the common case: no planner work after a step)
        profile = job_profile(self.job, self.profile)
        if found:
            node = max(found, key=found.get)
            c = choose(self.plan, profile, self.templates, ft.f, node, found[node], self.view,
                       ft.straggler)
        elif self.plan.digest() != resplit(self.plan, profile, {}).digest():  # (recovered)
            back = resplit(self.plan, profile, self.stragglers.slow)
            c = Choice(recovered[0], 1.0, "restore",
                       {"restore": round(predicted_step_ms(back, profile), 3)}, back)
        else:
            return
        if self.rank == 0 or c.node == self.node:
            self.events.emit("straggler", node=c.node, slowdown=c.slowdown, action=c.action,
                             predicted_ms=c.predicted_ms, step=self.engine.state.step,
                             plan=c.plan.digest() if c.plan is not None else None)
        if c.action == "keep":
            return
        self._watching = (c, statistics.median(self._step_s) if self._step_s else 0.0)
        self._step_s.clear()
        if c.action == "exclude":
            self._leave((c.node,), "excluded as a straggler", c.plan)
        else:
            self._switch(replace(c.plan, generation=self.gen))

    def _switch(self, plan) -> None:
        """Every rank moves to `plan`, the same layout with another batch split, after the same
        committed step: a new engine on the same groups adopts every layer (nothing moves);
        the old one stays the base until the new plan's first commit (`_committed`)."""
        from oobleck_hpc.engine import Engine

        old = self.engine
        old.release_step_memory()  # first: it drops the gradient views the new engine makes
        self.engine = Engine(self.job, self.model, plan, self.comm, old.groups, self.dataset,
                             self.device, state=replace(old.state), on_phase=self._on_phase,
                             abort=self.round_opened, adopt=old)
        self.base, self.base_plan, self.plan = old, self.plan, plan

