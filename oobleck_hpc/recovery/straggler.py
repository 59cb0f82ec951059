"""Stragglers: a node persistently slower than its profile predicts, re-planned around (pure).

Measure. Every rank times its own forward and backward computations in each step
(`StepResult.compute_s`: not the time it waits for peers) and puts it on its commit-vote ballot
with its step's time (recovery/driver.py), so after each committed step every rank holds the
same figures of every rank, at no extra round trip: every rank decides the same. A node's ratio
is the largest over its ranks of measured over predicted compute (its stage's forward +
backward per microbatch, from the templates, times its pipeline's microbatches). Profiles err
per stage, so a node is compared with itself: its baseline is its median ratio over the plan's
first `steps` steps (after the first, which allocates), and its slowdown in a step is its
ratio over its baseline, divided by the median node's (a machine that gets slower everywhere
makes nobody a straggler).

Detect (`Tracker`). A node's window is its last `steps` committed steps, or more until they
span `window_s` seconds (fault_tolerance.straggler_steps, straggler_window_s: "persistently"
means both, so that a few noisy steps decide nothing -- on a shared machine single steps vary by
tens of percent, and short steps by more). It is slow once the median of its slowdowns over
the window is >= `ratio` (straggler_ratio); that median is its slowdown s. It has recovered once the median is <= RECOVERED (or, on a plan
whose baseline was taken while it was slow, <= RECOVERED / s). So a slowdown is found at the
earliest `steps` steps after it starts (2 x `steps` + 1 on a new plan: first step and baselines).

Act (`choose`), by the planner's own prediction (`predicted_step_ms` with the slowdown: a
pipeline runs at the pace of its slowest node) for the plan at hand:
- keep: the plan as it is;
- rebalance: the same pipelines, the global batch re-split with the slow pipeline's costs
  scaled (`instantiate.resplit`, the optimisation the plan was made with): fewer microbatches
  for it. No layer moves; every rank rebuilds its engine in place on the same groups.
- exclude: the plan without the node (`reconfigure`, as for a loss); the node leaves like a
  drained one (control/drain.py): at the step boundary, nothing replayed.
The fastest wins unless it beats keeping by less than MIN_GAIN (then nothing is done); the
`straggler` event records the three predictions and the choice, `straggler_measured` the step
time measured before and after. A rebalanced node that recovered gets its share back (the split
without slowdown). `fault_tolerance.straggler` forces one action (rebalance, exclude) or turns
this off (none). Not built: moving the node to the stage where it hurts least.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

RECOVERED = 1.2
"""A slow node whose slowdown stays at or below this is fast again."""
WINDOW_CAP = 2000
"""At most this many steps in a window (a window_s longer than that many steps never fills)."""
MIN_GAIN = 0.05
"""An action must be predicted to shorten the step by at least this share."""


def expected_compute_ms(plan) -> dict[int, float]:
    """rank -> the forward and backward time its stage should take per step (templates)."""
    out = {}
    for info in plan.ranks:
        p = plan.pipelines[info.pipeline]
        t = p.template
        out[info.rank] = p.microbatches * (t.stage_forward_ms[info.stage]
                                           + t.stage_backward_ms[info.stage])
    return out


def ratios(plan, compute_s: Mapping[int, float]) -> dict[str, float]:
    """node -> its ratio (module docstring) from each rank's measured compute seconds."""
    want = expected_compute_ms(plan)
    ratio: dict[str, float] = {}
    for info in plan.ranks:
        if want[info.rank] > 0 and info.rank in compute_s:
            r = 1000.0 * compute_s[info.rank] / want[info.rank]
            ratio[info.node] = max(ratio.get(info.node, 0.0), r)
    return ratio


@dataclass(frozen=True)
class Choice:
    node: str
    slowdown: float
    action: str
    """keep, rebalance, exclude, or restore (a recovered node's share given back)."""
    predicted_ms: dict[str, float]
    plan: object | None = None
    """The plan to switch to (rebalance, restore; exclude: the plan without the node)."""


def choose(plan, profile, templates, f: int, node: str, slowdown: float, view,
           force: str = "auto") -> Choice:
    """The action for `node` slowed `slowdown` times (module docstring). `view`: the decided
    membership (excluding the node must keep the agents' quorum, as a drain must). `force`:
    auto, or the one action to take (rebalance, exclude)."""
    from oobleck_hpc.control.drain import verdict
    from oobleck_hpc.planning.cost import predicted_step_ms
    from oobleck_hpc.planning.instantiate import resplit

    slow = {node: slowdown}
    options = {"keep": (predicted_step_ms(plan, profile, slow), None)}
    balanced = resplit(plan, profile, slow)
    if balanced.digest() != plan.digest():
        options["rebalance"] = (predicted_step_ms(balanced, profile, slow), balanced)
    without = verdict(plan, [node], False, templates, profile, f, view).plan
    if without is not None:
        options["exclude"] = (predicted_step_ms(without, profile), without)
    predicted = {k: round(v[0], 3) for k, v in options.items()}
    if force != "auto":
        action = force if force in options else "keep"  # (e.g. one microbatch per pipeline)
    else:
        action = min(options, key=lambda k: options[k][0])
        if options[action][0] > (1 - MIN_GAIN) * options["keep"][0]:
            action = "keep"
    return Choice(node, round(slowdown, 3), action, predicted, options[action][1])


@dataclass
class Tracker:
    """Which nodes are slow, from each committed step's ratios (module docstring). Every rank
    feeds it the same figures (the vote's), so every rank decides the same."""

    ratio: float = 1.5
    steps: int = 5
    window_s: float = 0.0
    slow: dict[str, float] = field(default_factory=dict)
    """Nodes found slow: node -> slowdown then."""
    _base: dict[str, float] = field(default_factory=dict)
    """node -> its median ratio over the first `steps` steps of the plan (its baseline)."""
    _first: dict[str, list[float]] = field(default_factory=dict)
    _last: dict[str, deque] = field(default_factory=dict)
    _known_slow: set[str] = field(default_factory=set)
    """Slow nodes whose baseline was taken while they were slow (a plan made for them)."""
    _span: deque = field(default_factory=lambda: deque(maxlen=WINDOW_CAP))
    """The step times of the plan's steps (the window's length in seconds)."""

    def _window(self) -> int:
        """Steps in a window: at least `steps`, and as many as the last `window_s` took."""
        k, total = 0, 0.0
        for s in reversed(self._span):
            if k >= self.steps and total >= self.window_s:
                break
            k, total = k + 1, total + s
        return max(k, self.steps) if total >= self.window_s else WINDOW_CAP + 1

    def restart(self) -> None:
        """A new plan: ratios against another plan's predictions no longer compare."""
        self._span.clear()
        self._base.clear()
        self._first.clear()
        self._last.clear()
        self._known_slow = set(self.slow)

    def observe(self, ratios: Mapping[str, float],
                seconds: float = 0.0) -> tuple[dict[str, float], list[str]]:
        """One committed step's ratios (`ratios`; `seconds`: the step's time). Returns (nodes
        now slow: node -> slowdown, nodes now recovered). A node's window starts afresh after
        either."""
        self._span.append(seconds)
        if len(self._base) < len(ratios):  # the plan's baselines, once
            for node, r in ratios.items():
                self._first.setdefault(node, []).append(r)
            if min(len(v) for v in self._first.values()) >= self._window():
                self._base = {n: statistics.median(v) for n, v in self._first.items()}
            return {}, []
        rel = {n: r / self._base[n] for n, r in ratios.items() if self._base.get(n, 0) > 0}
        mid = statistics.median(rel.values())
        found, recovered = {}, []
        k = self._window()
        for node, x in rel.items():
            last = self._last.setdefault(node, deque(maxlen=WINDOW_CAP))
            last.append(x / mid)
            if len(last) < k:
                continue
            m = statistics.median(list(last)[-k:])
            if node in self.slow:
                # relative to a baseline taken while slow, recovering means getting faster
                limit = RECOVERED / self.slow[node] if node in self._known_slow else RECOVERED
                if m <= limit:
                    recovered.append(node)
                    del self.slow[node]
                    self._known_slow.discard(node)
                    last.clear()
            elif m >= self.ratio:
                found[node] = self.slow[node] = m
                last.clear()
        return found, recovered
