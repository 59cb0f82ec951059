"""The event-driven engine: a policy replays a trace, and every simulated second is accounted.

Time is continuous. Between two trace events a policy is in one phase: `train`, `recover`
(category `reconfiguration` or `restart`), `checkpoint` or `stopped` (too few nodes to run
anything). Phases end on their own (a recovery's cost elapses, a checkpoint is written, a step
completes) or are cut by the next trace event, to which the policy reacts (`on_fail`, `on_add`).
Training advances in whole steps computed arithmetically (k = floor(time / iteration)), so a week
of one-second steps costs a handful of operations per phase, not one per step.

Accounting (wall-clock seconds; the categories add up exactly to the simulated duration):

    effective        committed training: d * used/alive * useful
    redundant        redundant computation:   d * used/alive * (1 - useful)
    idle             nodes the plan leaves unused: d * (alive - used)/alive
    checkpoint       blocking checkpoint writes
    reconfiguration  in-place recovery (agreement, regroup, state copy) or rebalancing
    restart          process restart + checkpoint reload (and requeue)
    lost             training later thrown away: the interrupted step, or everything since the
                     last checkpoint when a policy falls back to it
    stopped          fewer nodes alive than the smallest runnable configuration

where `d` is a training interval, `alive` the job's nodes, `used` the nodes the current plan
runs on and `useful` the non-redundant fraction of a step (1 except for redundant computation).
Lost work is first booked as effective and moved to `lost` when it is discarded, so the shares
always sum to the duration. Samples count only work that was never discarded.

Two time series per policy, both (start_s, end_s, samples/s) segments covering [0, duration]:

    timeline   throughput: the rate at which the job trains, whether or not that work is kept
    goodput    the same, except that training later thrown away counts 0 -- the interrupted
               step that is replayed, and everything since the last checkpoint when a policy
               falls back to it. Recoveries, checkpoints and stops are 0 in both.

goodput <= timeline at every instant, and the integral of goodput is `samples` plus the part of
the step still in flight when the simulation ends (its work is not thrown away, only unfinished).
A training interval's fate is known only later, so the engine keeps the segments of the step in
flight and of the steps since the last checkpoint open, and zeroes them when they are discarded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CATEGORIES = ("effective", "redundant", "idle", "checkpoint", "reconfiguration", "restart",
              "lost", "stopped")


@dataclass(frozen=True)
class RunConfig:
    """How a policy trains on its current nodes."""

    iteration_s: float
    samples: float
    """Samples per iteration (the global batch)."""
    nodes_used: int
    useful: float = 1.0
    """Fraction of a step that is not redundant computation."""
    label: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_s


@dataclass
class PolicyResult:
    policy: str
    duration_s: float
    seconds: dict[str, float]
    samples: float
    steps: int
    failures: int
    fallbacks: int
    """Times the policy had to go back to a checkpoint."""
    timeline: list[tuple[float, float, float]]
    """(start_s, end_s, samples/s) segments: the instantaneous training throughput."""
    notes: list[str] = field(default_factory=list)
    goodput: list[tuple[float, float, float]] = field(default_factory=list)
    """(start_s, end_s, samples/s) segments: the throughput of work that is kept (training that
    was later thrown away counts 0); see the module docstring."""

    @property
    def shares(self) -> dict[str, float]:
        return {k: v / self.duration_s for k, v in self.seconds.items()}

    @property
    def samples_per_s(self) -> float:
        """Mean goodput: samples never thrown away, per simulated second."""
        return self.samples / self.duration_s

    def goodput_windows(self, window_s: float) -> list[tuple[float, float, float]]:
        """Goodput averaged over consecutive windows of `window_s` seconds (the last one may
        be shorter): (start_s, end_s, mean samples/s). Each window's rate times its length is
        the goodput integral over it."""
        return mean_over_windows(self.goodput, self.duration_s, window_s)

    def goodput_cumulative(self) -> list[tuple[float, float]]:
        """(time_s, samples kept so far) at every goodput segment boundary, from (0, 0)."""
        out, total = [(0.0, 0.0)], 0.0
        for t0, t1, rate in self.goodput:
            total += (t1 - t0) * rate
            out.append((t1, total))
        return out

    def to_dict(self) -> dict:
        return {"policy": self.policy, "duration_s": self.duration_s,
                "seconds": self.seconds, "shares": self.shares, "samples": self.samples,
                "samples_per_s": self.samples_per_s, "steps": self.steps,
                "failures": self.failures, "fallbacks": self.fallbacks,
                "timeline": [list(s) for s in self.timeline],
                "goodput": [list(s) for s in self.goodput], "notes": self.notes}


def mean_over_windows(series: list[tuple[float, float, float]], duration_s: float,
                      window_s: float) -> list[tuple[float, float, float]]:
    """Average a (start_s, end_s, rate) step series over consecutive windows of `window_s`
    covering [0, duration_s] (the last window ends at duration_s); time the series does not
    cover counts as rate 0."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, not {window_s!r}")
    out = []
    i = 0
    start = 0.0
    while start < duration_s:
        end = min(start + window_s, duration_s)
        area = 0.0
        while i < len(series) and series[i][1] <= start:
            i += 1
        j = i
        while j < len(series) and series[j][0] < end:
            t0, t1, rate = series[j]
            area += max(0.0, min(t1, end) - max(t0, start)) * rate
            j += 1
        out.append((start, end, area / (end - start)))
        start = end
    return out


class Policy:
    """Phase machine and bookkeeping shared by all policies; subclasses decide how to react."""

    name = "policy"

    def __init__(self, checkpoint_s: float = 0.0, checkpoint_every_steps: int = 0,
                 checkpoint_interval_s: float = 0.0):
        self.checkpoint_s = checkpoint_s
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_interval_s = checkpoint_interval_s
        self.sec = dict.fromkeys(CATEGORIES, 0.0)
        self.t = 0.0
        self.alive: list[str] = []
        self.run: RunConfig | None = None
        self.phase = "stopped"
        self.phase_left = 0.0
        self.phase_kind = ""
        self.after_phase: str | None = None
        self.step_done = 0.0          # seconds into the current step
        self.partial_eff = 0.0        # effective seconds booked for the current step
        self.pending_eff = 0.0        # effective seconds of completed steps since the checkpoint
        self.pending_samples = 0.0
        self.pending_steps = 0
        self.samples = 0.0
        self.steps = 0
        self.failures = 0
        self.fallbacks = 0
        self.timeline: list[tuple[float, float, float]] = []
        # goodput: every segment as booked ([start, end, rate], not merged), and the indices of
        # the still open ones: the step in flight, and completed steps since the checkpoint
        self._good: list[list[float]] = []
        self._good_partial: list[int] = []
        self._good_pending: list[int] = []
        self.notes: list[str] = []

    # ----------------------------------------------------------------- hooks for subclasses

    def start(self, nodes: tuple[str, ...]) -> None:
        raise NotImplementedError

    def on_fail(self, node: str) -> None:
        raise NotImplementedError

    def on_add(self, node: str) -> None:
        raise NotImplementedError

    def on_recovered(self, kind: str) -> None:
        """A recovery phase of `kind` finished; default: train on the current config."""
        self.train()

    # ----------------------------------------------------------------- phase control

    def train(self) -> None:
        self.phase = "train" if self.run is not None else "stopped"

    def recover(self, kind: str, seconds: float, keep_step: bool = False) -> None:
        """Enter (or restart) a recovery phase. The interrupted step is lost first, unless
        `keep_step` (redundant computation fails over without losing the step in flight)."""
        if not keep_step:
            self.lose_partial()
        self.phase, self.phase_kind, self.phase_left = "recover", kind, max(seconds, 0.0)

    def switch(self, run: RunConfig | None) -> None:
        """Adopt a new configuration; a kept partial step keeps its completed fraction."""
        if run is not None and self.run is not None and self.step_done:
            self.step_done = min(self.step_done / self.run.iteration_s, 1.0) * run.iteration_s
        elif run is None:
            self.lose_partial()
        self.run = run

    def checkpoint_now(self, then: str | None = None) -> None:
        self.phase, self.phase_left, self.after_phase = "checkpoint", self.checkpoint_s, then

    def steps_per_checkpoint(self) -> int:
        if self.checkpoint_every_steps > 0:
            return self.checkpoint_every_steps
        if self.checkpoint_interval_s > 0 and self.run is not None:
            return max(1, round(self.checkpoint_interval_s / self.run.iteration_s))
        return 0

    def lose_partial(self) -> None:
        """The step in flight is discarded (it will be replayed)."""
        self._move_to_lost(self.partial_eff)
        self.partial_eff = 0.0
        self.step_done = 0.0
        self._discard(self._good_partial)

    def lose_since_checkpoint(self) -> None:
        """Fall back to the last checkpoint: everything since it is discarded."""
        self.lose_partial()
        self._move_to_lost(self.pending_eff)
        self.samples -= self.pending_samples
        self.steps -= self.pending_steps
        self.pending_eff = self.pending_samples = 0.0
        self.pending_steps = 0
        self._discard(self._good_pending)
        self.fallbacks += 1

    def commit_checkpoint(self) -> None:
        self.pending_eff = self.pending_samples = 0.0
        self.pending_steps = 0
        self._good_pending.clear()  # on disk: never thrown away any more

    def _discard(self, pieces: list[int]) -> None:
        """The training of these goodput segments was thrown away: its goodput is 0."""
        for k in pieces:
            self._good[k][2] = 0.0
        pieces.clear()

    def _move_to_lost(self, seconds: float) -> None:
        self.sec["effective"] -= seconds
        self.sec["lost"] += seconds

    # ----------------------------------------------------------------- time

    def _book_training(self, d: float) -> float:
        """Book d seconds of training; returns the effective part."""
        run = self.run
        assert run is not None
        n = max(len(self.alive), run.nodes_used)
        used = run.nodes_used / n
        eff = d * used * run.useful
        self.sec["effective"] += eff
        self.sec["redundant"] += d * used - eff
        self.sec["idle"] += d - d * used
        return eff

    def _segment(self, t0: float, t1: float, rate: float) -> int | None:
        """Book [t0, t1] at `rate` in both series; returns the goodput segment's index."""
        if t1 <= t0:
            return None
        if self.timeline and self.timeline[-1][1] == t0 and self.timeline[-1][2] == rate:
            self.timeline[-1] = (self.timeline[-1][0], t1, rate)
        else:
            self.timeline.append((t0, t1, rate))
        self._good.append([t0, t1, rate])
        return len(self._good) - 1

    def advance_to(self, target: float) -> None:
        guard = 0
        while self.t < target:
            guard += 1
            if guard > 10_000_000:  # a bug, not input
                raise RuntimeError(f"{self.name}: simulation does not advance at t={self.t}")
            left = target - self.t
            if self.phase == "stopped":
                self.sec["stopped"] += left
                self._segment(self.t, target, 0.0)
                self.t = target
            elif self.phase in ("recover", "checkpoint"):
                d = min(self.phase_left, left)
                self.sec[self.phase_kind if self.phase == "recover" else "checkpoint"] += d
                self._segment(self.t, self.t + d, 0.0)
                self.t += d
                self.phase_left -= d
                if self.phase_left <= 1e-12:
                    self.phase_left = 0.0
                    if self.phase == "checkpoint":
                        self.commit_checkpoint()
                        then, self.after_phase = self.after_phase, None
                        if then is None:
                            self.train()
                        else:
                            self.on_recovered(then)
                    else:
                        self.on_recovered(self.phase_kind)
            else:
                self._advance_training(left)

    def _advance_training(self, left: float) -> None:
        run = self.run
        assert run is not None
        it = run.iteration_s
        t0 = self.t
        rate = run.samples / it
        to_finish = it - self.step_done
        if to_finish > left:  # the step in flight does not finish before the next event
            self.partial_eff += self._book_training(left)
            self.step_done += left
            self.t += left
            k = self._segment(t0, self.t, rate)
            if k is not None:
                self._good_partial.append(k)
            return
        # finish the step in flight, then whole steps, up to the checkpoint or the event
        every = self.steps_per_checkpoint()
        room = 1 + int(math.floor((left - to_finish) / it + 1e-9))
        if every:
            room = min(room, max(every - self.pending_steps, 1))
        d = min(to_finish + (room - 1) * it, left)  # min: float noise at the boundary
        eff = self.partial_eff + self._book_training(d)
        self.partial_eff = 0.0
        self.step_done = 0.0
        self.t += d
        self.steps += room
        self.samples += room * run.samples
        self.pending_steps += room
        self.pending_eff += eff
        self.pending_samples += room * run.samples
        k = self._segment(t0, self.t, rate)
        # the step in flight completed: its segments join the completed steps
        self._good_pending += self._good_partial
        self._good_partial.clear()
        if k is not None:
            self._good_pending.append(k)
        if every and self.pending_steps >= every:
            self.checkpoint_now()

    def result(self, duration_s: float) -> PolicyResult:
        goodput: list[tuple[float, float, float]] = []
        for t0, t1, rate in self._good:
            if goodput and goodput[-1][1] == t0 and goodput[-1][2] == rate:
                goodput[-1] = (goodput[-1][0], t1, rate)
            else:
                goodput.append((t0, t1, rate))
        return PolicyResult(self.name, duration_s, dict(self.sec), self.samples, self.steps,
                            self.failures, self.fallbacks, self.timeline, self.notes, goodput)


def simulate(policy: Policy, trace, duration_s: float) -> PolicyResult:
    """Replay `trace` (a sim.trace.Trace) under `policy` for `duration_s` seconds."""
    policy.start(trace.nodes)
    for ev in trace.events:
        if ev.time_s >= duration_s:
            break
        policy.advance_to(ev.time_s)
        if ev.kind == "fail":
            if ev.node in policy.alive:
                policy.failures += 1
                policy.on_fail(ev.node)
        else:
            if ev.node not in policy.alive:
                policy.on_add(ev.node)
    policy.advance_to(duration_s)
    return policy.result(duration_s)
