"""The chaos campaign's oracle: which outcomes a set of fired faults may have on a job's plan.

Expected outcome (`expected_outcomes`): the faults that fired (the run's `fault_injected`
events; a drawn fault whose phase the code does not fire is reported, not counted), each the loss
of its node (a `crash` too: once a step committed its node steps out, restarts its workers and
joins again, `rejoins`; a `drain` only where the job accepts it, `judge`; a `slow` node never: the
trials run with `straggler: none`), taken in membership rounds in time
order (`round_orders`): a step's own failures, then one round per recovery phase a further node
dies in, then a node lost after the step's commit, noticed while the next step runs (after the
last step: when the survivors agree they reached the end). Each round must keep the quorum of
the view before it (`control.decision.has_quorum`, the agents' rule), and the recovery, from
the plan of the last commit, must find every layer on a survivor, at least n0 survivors and a
plan (`planning.reconfigure`):
then in place, else fallback (and the rest of the set never fires: a requeued job runs without
faults). Where timing decides (did a vote complete before its node died; are nodes that fail in
the same window, each when it gets there, agreed away in one round or one by one) every way
counts, and any of their outcomes is expected.

A `grow` fault asks the launcher for a node: it never costs one, and the node it adds joins
after a loss (or waits as a spare, swapped in by the next loss's recovery) -- when depends on
how fast it starts. A node more only adds survivors and replicas, so where the set would fall
back without it, in place is expected too. The same holds for a crashed node that rejoins.

Stdlib and the planner only (no process, no torch.distributed): tests/test_chaos.py checks it
against a brute force on random plans.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from oobleck_hpc.config import FaultConfig
from oobleck_hpc.control.faults import IN_STEP_PHASES
from oobleck_hpc.control.membership import has_quorum

START_PHASES = ("rendezvous", "restore")
"""Fire before the first step of a run (`step` = the first step it trains: 1 for a trial)."""
RECOVERY_PHASES = ("reconfiguration", "transfer")
"""Fire only while the survivors recover from an earlier fault at the same step."""
AFTER_STEP_PHASES = ("checkpoint",)
"""Fire after the step committed (inside the periodic save)."""
AFTER_VOTE_PHASES = ("optimizer", "commit")
"""Fire after the commit vote completed: the step commits on every other node."""
STEP_PHASES = IN_STEP_PHASES
"""Fire inside a training step."""


def positions(x: FaultConfig, steps: int = 0) -> tuple[float, ...]:
    """Where the survivors may notice the loss of a fired fault's node, in step units (module
    docstring, "Expected outcome"). Step s (numbered from 1) fails at s; its recovery rounds are
    at s + 0.1 (reconfiguration) and s + 0.2 (transfer); it commits at s + 0.3; a node lost
    after that commit (optimizer, commit, a vote that completed elsewhere, the checkpoint after
    step s) is noticed at s + 0.5, while step s + 1 runs or, after the last step, when the
    survivors agree they reached the end (`ElasticDriver.finish`).

    A drain (`steps`: the run's last step) leaves right after the commit of whichever step's
    vote first carries its request -- step s or any later one, at s + 0.45 -- if the verdict
    then accepts it (`judge`); or never (inf): the run ended first."""
    s = x.step
    if x.kind in ("slow", "grow"):  # the node stays (the trials run with `straggler: none`)
        return (math.inf,)
    if x.kind == "drain":
        return tuple(c + 0.45 for c in range(max(1, s), steps + 1)) + (math.inf,)
    return _positions(x)


def _positions(x: FaultConfig) -> tuple[float, ...]:
    s = x.step
    if x.phase in START_PHASES:
        return (-1.0,)
    if x.phase == "vote":
        return (s, s + 0.5)
    if x.phase in AFTER_VOTE_PHASES or x.phase == "checkpoint":
        return (s + 0.5,)
    if x.phase in RECOVERY_PHASES:
        return (s + 0.1 * (1 + RECOVERY_PHASES.index(x.phase)),)
    return (float(s),)


def rejoins(x: FaultConfig) -> bool:
    """Whether a `crash` fault's node may come back after its loss: its agent restarts the
    workers and the node joins again once a step committed on it (control/agent.py) -- from
    step 2 on, after step 1's commit (its checkpoint), and maybe in step 1's vote, optimizer
    and commit windows, where a local peer may have committed first."""
    return x.step >= 2 and x.phase not in START_PHASES or \
        x.step == 1 and x.phase in ("checkpoint", "vote", *AFTER_VOTE_PHASES)


def round_orders(faults: Sequence[FaultConfig],
                 steps: int = 0) -> list[list[tuple[float, list[FaultConfig]]]]:
    """Every order the fired `faults` can be lost in: [(position, faults)] by position
    (`positions`), one entry per way a vote fault can go (did its vote complete elsewhere?).
    Faults at one position fire on each node when it gets there (the rendezvous seconds apart on
    a loaded machine, a commit tens of ms apart) while a round is decided in milliseconds: they
    may be agreed away in one round or several, in any order (`judge` counts every way). A node
    lost after step s's commit is noticed while step s + 1 runs: it joins step s + 1's losses."""
    orders = []
    for pick in itertools.product(*(positions(x, steps) for x in faults)):
        at: dict[float, list[FaultConfig]] = {}
        for x, p in zip(faults, pick):
            at.setdefault(p, []).append(x)
        for p in [p for p in at if p % 1 == 0.5 and p + 0.5 in at]:
            at[p + 0.5] = at.pop(p) + at[p + 0.5]
        orders.append(sorted(at.items()))
    return orders


def layers_kept(plan, lost: set[str]) -> bool:
    """Every layer of `plan` still has a holder on a node not in `lost`."""
    kept = {layer for r in plan.ranks if r.node not in lost
            for layer in range(r.layer_start, r.layer_end)}
    return len(kept) == plan.num_layers


def quorum_ways(view: Sequence[str], survivors: Sequence[str], quorum: str) -> set[bool]:
    """Whether the `survivors` of `view` keep the quorum, over every way of losing the others:
    in one round or several, in any order. At once is the strictest way (if it keeps the quorum,
    every way does); one by one, the first node of the view last, the most lenient."""
    at_once = has_quorum(view, survivors, quorum)
    if at_once:
        return {True}
    # One by one: a view of 3 or more keeps a majority losing one node; from 2 to 1 only the
    # view's first node may stay, so the last node lost must come after the survivor.
    one_by_one = len(survivors) >= 2 or (
        len(survivors) == 1 and view.index(survivors[0]) < len(view) - 1)
    return {False, True} if one_by_one else {False}


def judge(order: list[tuple[float, list[FaultConfig]]], plan, templates, profile, f: int,
          quorum: str = "majority") -> set[str]:
    """The outcomes ('in_place', 'fallback') of one order of losses on the job's initial `plan`.
    Each round must keep the quorum of the view before it (`quorum_ways`); a recovery starts
    from the plan of the last commit (its base: the driver reconfigures the base without every
    node lost since, and moves layers only from the base's holders): every layer must keep a
    holder on the base's surviving nodes, at least n0 of them, and the planner must have a plan
    for them. A drain (only drains share its positions) happens only where the driver's
    verdict accepts it (control/drain.py: the quorum kept at once and a plan without the nodes,
    from the plan just committed); refused, nothing changes."""
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.planning.reconfigure import reconfigure

    n0 = min(templates)
    out: set[str] = set()
    view, base, current, lost, last = list(plan.nodes), plan, plan, set(), None
    for p, group in order:
        gone = {f"node{x.node}" for x in group} & set(view)
        if not gone or p == math.inf:
            continue
        if group[0].kind == "drain":
            from oobleck_hpc.control.drain import verdict

            if not verdict(current, sorted(gone), False, templates, profile, f, view).accepted:
                continue
        if last is not None and math.floor(p - 0.3) > math.floor(last - 0.3):
            base, lost = current, set()  # a step committed on `current` in between
        last = p
        survivors = [n for n in view if n not in gone]
        ways = quorum_ways(view, survivors, quorum)
        if False in ways:
            out.add("fallback")
            if True not in ways:
                return out
        lost |= gone
        if not layers_kept(base, lost) or len(base.nodes) - len(lost) < n0:
            return out | {"fallback"}
        try:
            current = reconfigure(base, lost, templates, profile, f)
        except GuaranteeExceeded:
            return out | {"fallback"}
        view = survivors
    return out | {"in_place"}


def expected_outcomes(faults: Sequence[FaultConfig], plan, templates, profile, f: int,
                      quorum: str = "majority", steps: int = 0) -> list[str]:
    """The outcomes `faults` (those that fired) may have: `judge` over every `round_orders`
    (`steps`: the run's last step, for drains).

    A drain may leave after any step from its own to the last (`positions`), but every step
    after the set's last fault orders the rounds alike (the drain comes last, after a commit):
    the steps are cut there, so that a trial's tail of steps does not multiply the orders."""
    from oobleck_hpc.recovery.rounds import MAX_ROUNDS

    if faults:
        steps = min(steps, max(x.step for x in faults) + 1)
    out = set().union(*(judge(order, plan, templates, profile, f, quorum)
                        for order in round_orders(faults, steps)))
    if rounds_at_one_step(faults) > MAX_ROUNDS:
        out.add("fallback")  # (`rounds_at_one_step`)
    if any(x.kind == "grow" or x.kind == "crash" and rejoins(x) for x in faults):
        out.add("in_place")  # (module docstring: a node more only adds survivors and replicas)
    return sorted(out)


def rounds_at_one_step(faults: Sequence[FaultConfig]) -> int:
    """The most membership rounds the fired `faults` can open while the job recovers one step:
    one per fault at that step in the step or one of its recovery's windows (faults in one
    window may be agreed away one by one), a rejoining node's or a grown node's join round
    included. A recovery falls back after MAX_ROUNDS + 1 failed rounds
    (recovery/rounds.py, each rank counting its own): k rounds fail k - 1 times by the faults
    alone, and a round also fails when a joiner drops a connection, so from MAX_ROUNDS + 1 faults at one step on, the fallback is expected too."""
    at: dict[int, int] = {}
    for x in faults:
        if x.kind not in ("slow", "drain") and x.phase in STEP_PHASES + RECOVERY_PHASES:
            at[x.step] = at.get(x.step, 0) + 1
    return max(at.values(), default=0)
