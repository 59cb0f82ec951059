"""In-band hang detection: a worker that waits too long inside a step's communication tells its
agent, which pings the peers it waits on (control/stall_probe.py).

A hung node (SIGSTOP, a frozen host) closes nothing: its peers only see silence, which the
agents' lease turns into a suspicion after lease_s (3 s). Inside a step, every rank that waits
on the hung node knows much sooner that something is wrong: its wait lasts far longer than a
step usually takes. So each worker runs a watchdog thread (`Watchdog`) that looks, every
POLL_S, at what the training thread waits for -- the engine's transfer or collective
(`Engine.waiting`: since when, on which ranks), or the commit vote's exchange over the control
plane (`DriverState.voting`) -- and, once that wait is longer than

    max(STALL_FLOOR_S, STALL_MULTIPLE x the usual step time)

(`StallWatch.threshold`; the usual step time is the low median of the last STALL_STEPS
committed steps, as the vote counted them: the slowest rank's time -- the low median, so that
the first step, which allocates and may take seconds, does not set the threshold of the
second and third; configs/resilience.py says why these values), reports a stall to its agent: `client.report_failure("stall", detail, suspects, gen)`
with the nodes of the ranks it waits on (the transfer's peer, the collective's group; none for
the vote, whose missing voters only the agents know). At most once per generation and step:
the report asks for a probe, nothing else, so one is enough. The report does not abort the
wait: if the agent finds a suspect silent, its round aborts the step as any loss does; if every
suspect answers, the wait goes on (a straggler is slow, not hung: recovery/straggler.py), and
the lease and the collective timeout still bound it.

A recovery's rendezvous reports the same way (`watched`, recovery/generation.py): a rank that
has waited that threshold (STALL_FLOOR_S before any step committed) for the plan's ranks to
reach the store names the nodes of those still missing (recovery/rendezvous.py,
`missing_nodes`; chaos seed 5202, trial 33: a node hung in generation 2's rendezvous held the
others for its 3.3 s lease); so do its connect to the generation's store, naming the store's
host, and its transfer, naming the peers of the rank that waits (recovery/transfer.py,
`peers`). Not watched: a start, a recovery's group build (gloo's connect cannot be
interrupted, and is bounded by the collective timeout instead: engine/groups.py,
`gloo_connect_timeout`), and a worker's first step (no usual time yet): there the lease alone
finds a hung node.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from oobleck_hpc.config import STALL_FLOOR_S, STALL_MULTIPLE, STALL_STEPS

if TYPE_CHECKING:
    from oobleck_hpc.recovery.state import DriverState

POLL_S = 0.02
"""How often the watchdog looks at the training thread's wait (a few attribute reads)."""


@dataclass(frozen=True)
class Wait:
    """A wait of the training thread inside a step: since when (time.monotonic()), where, and on
    which nodes (empty: unknown, e.g. the commit vote)."""

    since: float
    phase: str
    nodes: tuple[str, ...]
    gen: int
    step: int


@dataclass(frozen=True)
class Stall:
    """A wait found too long: what the worker reports."""

    wait: Wait
    waited_s: float
    threshold_s: float

    @property
    def detail(self) -> str:
        return (f"waited {self.waited_s:.2f} s in {self.wait.phase} of step {self.wait.step + 1} "
                f"(threshold {self.threshold_s:.2f} s) on "
                f"{', '.join(self.wait.nodes) if self.wait.nodes else 'every member'}")


@dataclass
class StallWatch:
    """When a wait is a stall (module docstring; pure: the caller passes the clock's time).
    `observe` is called by the training thread, `due` by the watchdog's."""

    floor_s: float = STALL_FLOOR_S
    multiple: float = STALL_MULTIPLE
    steps: int = STALL_STEPS
    _times: deque[float] = field(init=False)
    _reported: tuple[int, int] | None = None
    """(generation, step) of the last stall reported."""

    def __post_init__(self) -> None:
        self._times = deque(maxlen=self.steps)

    def observe(self, step_s: float) -> None:
        """A step committed and took `step_s` seconds."""
        self._times.append(step_s)

    @property
    def threshold(self) -> float | None:
        """How long a wait may last before it is a stall; None before any step committed."""
        times = list(self._times)
        if not times:
            return None
        return max(self.floor_s, self.multiple * statistics.median_low(times))

    def due(self, wait: Wait | None, now: float) -> Stall | None:
        """The stall to report now, if `wait` is one and its step's was not reported yet."""
        threshold = self.threshold
        if wait is None or threshold is None or (wait.gen, wait.step) == self._reported:
            return None
        waited = now - wait.since
        if waited < threshold:
            return None
        self._reported = (wait.gen, wait.step)
        return Stall(wait, waited, threshold)


def watched(s: DriverState, gen: int, where: str, late: Callable[[], list[str]],
            abort: Callable[[], bool]) -> Callable[[], bool]:
    """`abort` for a wait of a recovery of generation `gen` outside a step (module docstring),
    called at each poll of the wait (its first call starts the clock): once the wait has lasted
    a stall's threshold (STALL_FLOOR_S before any step committed), the nodes `late()` names
    are reported as a stall, once, for their agents to be probed (the agent leaves out its
    own). The wait goes on."""
    after_s = s.stalls.threshold or STALL_FLOOR_S
    since: float | None = None

    def check() -> bool:
        nonlocal since
        now = time.monotonic()
        if since is None:
            since = now
        elif now - since >= after_s:
            since = math.inf  # (reported: never again)
            nodes = late()
            if nodes:  # (none: every member would be probed)
                s.client.report_failure(
                    "stall", f"waited {after_s:.2f} s in {where} of generation {gen} on "
                    f"{', '.join(nodes)}", nodes, gen=gen, threshold_s=after_s)
        return abort()

    return check


def current_wait(s: DriverState) -> Wait | None:
    """What the training thread of `s` waits for inside a step now (read from another thread:
    each field is read once)."""
    gen, voting, engine = s.gen, s.voting, s.engine
    if voting is not None:
        return Wait(voting[0], "vote", (), gen, voting[1])
    if engine is None:
        return None
    w, plan, step = engine.waiting, engine.plan, engine.state.step
    if w is None:
        return None
    nodes = sorted({plan.ranks[r].node for r in w.ranks if 0 <= r < len(plan.ranks)})
    return Wait(w.since, w.phase, tuple(nodes), gen, step)


class Watchdog:
    """The worker's stall watchdog thread (module docstring): `report(stall)` for each stall."""

    def __init__(self, s: DriverState, report: Callable[[Stall], None],
                 clock: Callable[[], float] = time.monotonic):
        self.s, self.report, self.clock = s, report, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.s.stalls.threshold is None:
                continue  # no step committed yet: nothing to compare with
            stall = self.s.stalls.due(current_wait(self.s), self.clock())
            if stall is not None:
                try:
                    self.report(stall)
                except Exception:  # noqa: BLE001 - the agent is gone: the worker exits anyway
                    return
