"""Who watches whom on the control plane: K rings over the view, and the rule that turns lease
expiries into a suspicion. Pure (no sockets, no clocks of its own): plane.py feeds it times.

Monitoring topology (`Rings`)
-----------------------------
Every agent computes the same K rings from the decided view alone: ring r orders the view by a
hash of (r, node name), and every node watches its successor in each ring (its *subjects*) and
is watched by its predecessor in each (its *observers*): at most K of each, whatever the job's
size. The union of K random rings is an expander, so the graph stays connected and of small
diameter when nodes fail (the Rapid membership service, ATC'18, monitors the same way). With
N <= K + 1 nodes most pairs watch each other, as the full mesh did.

Load: a subject sends HEARTBEAT to its observers every heartbeat_s and an observer holds a
lease on each subject, so an agent sends and receives at most 2K heartbeats per heartbeat_s,
independent of N (the full mesh: 2(N - 1)).

Suspicion (`Detector`)
----------------------
- A lease that expires (or a subject never heard from since the edge began) makes the observer
  REPORT the subject to the subject's other observers -- K messages per report.
- An observer suspects the subject once more than half of the subject's observers that are
  still members (not suspected, not left) have reported it in this generation, itself counted
  among them (its own report, or, while its own lease holds, a vote against). So one slow or
  partitioned observer cannot evict a healthy node, also not one with only two observers (the
  other observer once did not count itself and suspected on the first one's report alone: a
  healthy agent of a 5-node test, unscheduled for 3 s, was evicted so), and a hung node,
  whose K observers all stop hearing it at the same moment, is suspected at lease_s as before.
  When observers themselves fail (a switch taking 32 nodes with it), the ones left decide.
- An observer's own pause does not count against its subjects: after a tick more than two
  heartbeats late (this agent was not scheduled), each lease is extended by the pause. A
  subject's heartbeats sent meanwhile may still sit unread in its sockets when the tick runs,
  or the subject paused too (a machine-wide stall). Seen twice in tests on a 2-core machine
  as ten workers began their first step: both observers of a healthy node reported it silent
  for 3.05 s within 30 ms of each other while every worker ran seconds late, and it answered
  its exclusion at once. A hung subject is found that much later (the stall probe, in band,
  is unaffected). Nor does a pause fence the agent itself, however long (`Own pause`).
- A subject silent to an observer for two leases is suspected by that observer alone: the
  observers that would confirm it are out of reach (a partition: the reports do not cross it
  either), and a single observer that long out of touch is itself cut off from the subject.
- A dropped connection, a failed send, FAILED, BYE and a worker's report naming a peer are
  direct evidence and still make a suspicion at once (plane.py): the kernel closes a
  SIGKILLed agent's sockets in milliseconds, and that fast path stays.
- An edge starts with a fresh lease when it appears (a new generation's topology, a joiner):
  a subject is expected to be heard from within lease_s of the moment one starts watching it,
  or within startup_s of the start for generation 0.
- The start has a longer lease (`Monitor(start_lease_s=...)`; the agents' is START_LEASE_FACTOR
  x lease_s) for the leases this agent holds, until this node's workers are past their start
  (`Monitor.started`: every rank of the start built its engine, recovery/driver.py
  `_start_together`, or one committed a step). While ten workers import torch and build their
  models on a 2-core CI machine, healthy agents went unscheduled for 3.0 s and 4.5 s, over
  lease_s = 3, and were excluded before step 1. A kill at the start is still found at once
  (its connections close); a hang there, later.

Own pause
---------
An agent that was not scheduled for longer than its lease (SIGSTOP, a swap storm, a stalled
machine) does not fence itself on that alone. If its peers ran meanwhile, they excluded it, and
the first heartbeat it sends on resuming is answered with FENCE (membership.py, 6): it ends with
exit 3 a round trip later, and its workers cannot commit a step with peers that left their
group. Nor does the pause count against a round it waits on (agreement_timeout_s, which fences
for a requeue). If its peers were paused too -- every agent of one host at once, which runs all
the nodes of a local job: 4.5 s with lease_s = 3 in a chaos trial on a 2-core machine -- each
observer's lease excused its own pause and nobody excluded anybody; the self-fence this replaced
fenced two healthy agents so, and the job fell back to its checkpoint. Safety never rested on
it: only a quorum decides a node away (membership.py).

How late this machine runs (`Lateness`)
---------------------------------------
The monitor also measures how long agents go unscheduled: a subject heartbeats at most
1.5 x heartbeat_s apart (every heartbeat_s, on ticks heartbeat_s / 2 apart), and this agent's
own ticker runs every heartbeat_s / 2; what a gap exceeds that by is lateness (the sender's, the
network's or this agent's own). The largest of the last LATE_WINDOW_S is what a short deadline
must allow for (the stall probe's, control/stall_probe.py): on a quiet or merely busy machine
it is milliseconds, but a 2-core CI machine starting torch in several processes at once left
healthy agents unscheduled for over 0.35 s, and a fixed deadline suspected three of them.
What the start cost is forgotten once this node trains (plane.py, `open_joins`): its imports
and model builds are over, every rank of the start having built its engine before step 1
(recovery/driver.py, `_start_together`), and a start's lateness of 0.36-0.75 s kept a hang at
step 5 waiting a 0.7-1.5 s deadline (`bench/recovery.py --modes hang`). A node that starts
while the job trains (grown, a worker restarted) makes its peers late while they train: that
is noted and kept.
Failure detectors that adapt to the heartbeats' observed arrivals, such as the phi accrual
detector (Hayashibara et al., SRDS 2004), rest on the same evidence.
"""

from __future__ import annotations

import functools
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from oobleck_hpc.errors import EXIT_REQUEUE

MONITORS = 4
"""K: rings in the monitoring topology (subjects and observers per agent, at most)."""
LATE_WINDOW_S = 30.0
"""How long an agent remembers the lateness it measured (module docstring: `Lateness`)."""
START_LEASE_FACTOR = 3.0
"""The start's lease over lease_s (module docstring: `Detector`, the start's lease)."""
PAUSE_TICKS = 4
"""A tick this many ticks apart (2 heartbeats) means this agent itself paused: its leases are
extended by the pause (module docstring: `Detector`, an observer's own pause)."""


@functools.lru_cache(maxsize=1 << 17)
def _ring_key(ring: int, node: str) -> bytes:
    return hashlib.blake2b(f"{ring}\0{node}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Rings:
    """The K-ring monitoring topology over `view` (see the module docstring)."""

    view: tuple[str, ...]
    k: int = MONITORS
    _subjects: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _observers: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        subjects: dict[str, list[str]] = {n: [] for n in self.view}
        observers: dict[str, list[str]] = {n: [] for n in self.view}
        if len(self.view) > 1:
            for r in range(self.k):
                ring = sorted(self.view, key=lambda n: _ring_key(r, n))
                for i, node in enumerate(ring):
                    nxt = ring[(i + 1) % len(ring)]
                    if nxt not in subjects[node]:
                        subjects[node].append(nxt)
                        observers[nxt].append(node)
        object.__setattr__(self, "_subjects", {n: tuple(s) for n, s in subjects.items()})
        object.__setattr__(self, "_observers", {n: tuple(o) for n, o in observers.items()})

    def subjects(self, node: str) -> tuple[str, ...]:
        """The nodes `node` watches (holds a lease on)."""
        return self._subjects.get(node, ())

    def observers(self, node: str) -> tuple[str, ...]:
        """The nodes that watch `node` (it sends them its heartbeats)."""
        return self._observers.get(node, ())


@functools.lru_cache(maxsize=8)
def rings_of(view: tuple[str, ...], k: int = MONITORS) -> Rings:
    """The topology of `view`, computed once per view in this process (every agent of a
    simulation shares it; an agent computes it once per generation)."""
    return Rings(view, k)


@dataclass
class Detector:
    """One agent's leases on its subjects and the reports of lease expiries it has seen.

    `watch()` after every decision; `heard()` for every message; `expired()` on every tick:
    the subjects to report (again every lease_s while they stay silent, so that a report lost
    to a peer that had not reached this generation yet is made good); `report()` for a report
    (one's own or a peer's): True when the subject is to be suspected now."""

    me: str
    lease_s: float
    k: int = MONITORS
    rings: Rings = field(init=False)
    gen: int = field(init=False, default=-1)
    _since: dict[str, tuple[float, float]] = field(init=False, default_factory=dict)
    """subject -> (when its edge began, when a first message was due at the latest)."""
    last_heard: dict[str, float] = field(init=False, default_factory=dict)
    """When each peer was last heard from (any message), by the control plane's clock."""
    _reported: dict[str, float] = field(init=False, default_factory=dict)
    _reports: dict[str, set[str]] = field(init=False, default_factory=dict)
    _excused: dict[str, float] = field(init=False, default_factory=dict)
    """subject -> a lease's start moved later by this agent's own pauses (`paused`)."""

    def __post_init__(self) -> None:
        self.rings = Rings((), self.k)

    def watch(self, gen: int, view: tuple[str, ...], now: float, extra: tuple[str, ...] = (),
              grace_s: float = 0.0) -> None:
        """Watch the subjects of `view`'s topology plus `extra` (e.g. an open round's joiners)
        from generation `gen` on; an edge new here gets a fresh lease (`grace_s` more for the
        start: until the subject was first heard from). Reports of an older generation are
        forgotten."""
        if gen != self.gen or view is not self.rings.view:  # (a view is one tuple per decision)
            self.rings = rings_of(view, self.k)
        if gen != self.gen:
            self.gen, self._reported, self._reports = gen, {}, {}
        want = [n for n in self.rings.subjects(self.me) + extra if n != self.me]
        # A new generation ends the start's grace: a subject never heard from is due from now.
        self._since = {n: (self._since[n][0], min(self._since[n][1], now + grace_s))
                       if n in self._since else (now, now + grace_s) for n in dict.fromkeys(want)}
        self._excused = {n: t for n, t in self._excused.items() if n in self._since}

    @property
    def subjects(self) -> tuple[str, ...]:
        return tuple(self._since)

    def heard(self, node: str, now: float) -> None:
        self.last_heard[node] = now

    def watched_since(self, node: str) -> float:
        """When this agent's edge to subject `node` began (it heartbeats this agent since);
        infinity for a node that is not a subject."""
        return self._since[node][0] if node in self._since else float("inf")

    def paused(self, seconds: float) -> None:
        """This agent itself ran `seconds` late (it was not scheduled): no lease runs for that
        time. A subject's heartbeats sent meanwhile may wait unread in this agent's sockets,
        or the subject paused too (a machine-wide stall), and a lease judged on the clock alone
        would expire at this agent's first tick after it. (`last_heard` keeps the true times:
        the stall probe asks whether a node was heard since.)"""
        for node in self._since:
            self._excused[node] = self._lease_start(node) + seconds

    def _lease_start(self, node: str) -> float:
        """When subject `node`'s current lease began: its last message (or when one was due,
        never heard from), no earlier than its edge, moved on by this agent's own pauses."""
        since, due = self._since[node]
        heard = self.last_heard.get(node)
        return max(due if heard is None else max(heard, since), self._excused.get(node, -1e18))

    def expired(self, now: float, skip: set[str]) -> list[tuple[str, str, bool]]:
        """(subject, how, alone) for each subject silent for more than lease_s since its edge
        began, not reported in the last lease_s (`skip`: already suspected or gone); `alone`:
        silent for two leases, to be suspected without the other observers."""
        out = []
        for node in self._since:
            if node in skip or now - self._reported.get(node, -1e18) <= self.lease_s:
                continue
            heard = self.last_heard.get(node)
            last = self._lease_start(node)
            if now - last > self.lease_s:
                self._reported[node] = now
                out.append((node, "never_connected" if heard is None else
                            f"lease_expired (silent {now - last:.2f} s)",
                            now - last > 2 * self.lease_s))
        return out

    def observers(self, subject: str, gone: set[str]) -> tuple[str, ...]:
        """The subject's observers in this generation that are not `gone`."""
        return tuple(o for o in self.rings.observers(subject) if o not in gone)

    def report(self, subject: str, observer: str, gone: set[str]) -> bool:
        """`observer` reports `subject` silent in this generation. True once more than half of
        the subject's observers that are not `gone` have reported it. A subject outside the
        topology (an open round's joiner, watched by every member) needs one report."""
        if self.rings.observers(subject) and observer not in self.rings.observers(subject):
            return False
        self._reports.setdefault(subject, set()).add(observer)
        return self._enough(subject, gone)

    def reporters(self, subject: str) -> set[str]:
        return set(self._reports.get(subject, ()))

    def recount(self, gone: set[str]) -> list[str]:
        """Subjects whose reports suffice now that more observers are `gone`."""
        return [s for s in self._reports if s not in gone and self._enough(s, gone)]

    def _enough(self, subject: str, gone: set[str]) -> bool:
        # This agent's own say counts whenever it observes the subject: while its own lease
        # holds it is a vote for the subject (`gone` may name this agent: the monitor's does).
        live = self.observers(subject, gone - {self.me})
        return 2 * len(self._reports.get(subject, set()) & set(live)) > len(live) if live \
            else bool(self._reports.get(subject))


class Lateness:
    """The largest lateness noted in the last `window_s` (module docstring), in O(1) amortized:
    a deque of (time, lateness) whose lateness decreases from its front (a sliding maximum)."""

    def __init__(self, window_s: float = LATE_WINDOW_S):
        self.window_s = window_s
        self._seen: deque[tuple[float, float]] = deque()

    def note(self, now: float, late: float) -> None:
        if late <= 0.0:
            return
        while self._seen and self._seen[-1][1] <= late:
            self._seen.pop()
        self._seen.append((now, late))

    def forget(self) -> None:
        """Drop all lateness noted so far (the start's: module docstring)."""
        self._seen.clear()

    def recent(self, now: float) -> float:
        while self._seen and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        return self._seen[0][1] if self._seen else 0.0


class Monitor:
    """Failure detection around one agent's `MembershipCore`, pure: what plane.py runs on
    every tick and every message (and the control plane's simulator, testing/netsim.py, too).

    `tick(now)` every heartbeat_s / 2: excuses this agent's own pause (module docstring, `Own
    pause`) from the leases it holds and from the open round's wait; fences the node if a round
    kept the same proposal for agreement_timeout_s without a decision (it cannot prove it is in
    the majority: exit 75, requeue); sends the heartbeats that are due, reports the subjects
    whose lease expired; returns whom it heartbeats. `message()` for every message received;
    True when it was a REPORT (consumed here). What it sends goes to the core's outbox; the
    suspicions it makes, to the core."""

    def __init__(self, core: Any, heartbeat_s: float, lease_s: float, startup_s: float,
                 k: int = MONITORS, agreement_timeout_s: float | None = None,
                 emit: Callable[..., object] | None = None, start_lease_s: float = 0.0):
        self.core, self.heartbeat_s, self.lease_s = core, heartbeat_s, lease_s
        self.startup_s = startup_s
        self.agreement_timeout_s = agreement_timeout_s or 2 * lease_s
        self._seen: tuple[Any, float] = (None, 0.0)  # the open round's proposal, since when
        self.detector = Detector(core.me, max(lease_s, start_lease_s), k)
        """Its lease_s is the start's until `started()` (module docstring)."""
        self.lateness = Lateness()
        """How late heartbeats and this agent's ticks ran lately (module docstring)."""
        self.emit = emit or (lambda kind, **fields: None)
        self._trains = False  # a worker of this node committed a step (`trains`)
        self.t0 = self._last_tick = self._last_hb = 0.0

    def start(self, now: float) -> None:
        self.t0 = self._last_tick = self._last_hb = now

    def started(self) -> None:
        """This node's workers are past their start: lease_s from now on (module docstring)."""
        if self.detector.lease_s != self.lease_s:
            self.detector.lease_s = self.lease_s
            self.emit("start_lease_ended", lease_s=self.lease_s)

    @property
    def starting(self) -> bool:
        """This node's workers are not past their start yet (the start's longer lease)."""
        return self.detector.lease_s != self.lease_s

    def trains(self) -> None:
        """A step committed here: the start is over. The first time, forget how late this
        machine ran until then (module docstring, `Lateness`: the start)."""
        if not self._trains:
            self._trains = True
            self.lateness.forget()
        self.started()

    def gone(self) -> set[str]:
        return set(self.core.suspects) | self.core.left | {self.core.me}

    def tick(self, now: float) -> list[str]:
        core = self.core
        gap, self._last_tick = now - self._last_tick, now
        if core.fenced:
            return []
        self.lateness.note(now, gap - self.heartbeat_s / 2)
        if gap > PAUSE_TICKS * self.heartbeat_s / 2:  # (not a busy machine's jitter)
            pause = gap - self.heartbeat_s / 2
            self.detector.paused(pause)
            self._seen = (self._seen[0], self._seen[1] + pause)  # nor the round's agreement
        if core.proposal is not self._seen[0]:
            self._seen = (core.proposal, now)
        elif core.proposal is not None and now - self._seen[1] > self.agreement_timeout_s:
            core.fence(f"no agreement on {list(core.proposal)} within agreement_timeout_s="
                       f"{self.agreement_timeout_s}", code=EXIT_REQUEUE)
            return []
        targets = self._watch(now)
        if now - self._last_hb >= self.heartbeat_s:
            self._last_hb = now
            for node in targets:
                core.outbox.append((node, {"type": "heartbeat", "gen": core.decided.gen}))
        for node, how, alone in self.detector.expired(now, self.gone()):
            if alone:
                core.suspect(node, f"{how}: no other observer confirmed it in time")
            else:
                self.report(node, core.me, how)
        return targets

    def message(self, src: str, msg: dict[str, Any], now: float) -> bool:
        last = self.detector.last_heard.get(src)
        if last is not None and self.detector.watched_since(src) <= last:
            self.lateness.note(now, now - last - 1.5 * self.heartbeat_s)  # (a subject's gap)
        self.detector.heard(src, now)
        if msg.get("type") != "report":
            return False
        if msg.get("gen") == self.detector.gen and self.core.joined:
            self.report(msg["node"], src, str(msg.get("how", "lease_expired")))
        return True

    def report(self, subject: str, observer: str, how: str) -> None:
        """`observer` (this agent or a peer) found `subject` silent; suspect it once most of
        its observers did. This agent's own report goes to the subject's other observers."""
        gone = self.gone()
        if subject in gone:
            return
        core = self.core
        if observer == core.me:
            observers = self.detector.observers(subject, gone)
            self.emit("silence_reported", node=subject, how=how, observers=list(observers))
            for node in observers:
                if node != core.me:
                    core.outbox.append((node, {"type": "report", "node": subject,
                                               "gen": self.detector.gen, "how": how}))
        if self.detector.report(subject, observer, gone):
            self._suspect_reported(subject, how)

    def _suspect_reported(self, subject: str, how: str) -> None:
        reporters = sorted(self.detector.reporters(subject))
        self.core.suspect(subject, how if reporters == [self.core.me] else
                          f"{how} (reported by {', '.join(reporters)})")

    def _watch(self, now: float) -> list[str]:
        """The detector on the current generation's topology; whom to heartbeat. A member
        watches its subjects and the open round's joiners; a joiner in a round watches the
        members and they it; a spare outside a round nobody."""
        core, view = self.core, self.core.decided.nodes
        extra = (core.round_joiners if core.joined else
                 view if core.proposal is not None else ())
        grace = max(0.0, self.t0 + self.startup_s - self.detector.lease_s - now) \
            if core.decided.gen == 0 else 0.0
        self.detector.watch(core.decided.gen, view if core.joined else (), now, extra, grace)
        for node in self.detector.recount(self.gone()):
            self._suspect_reported(node, "lease_expired")
        gone = self.gone()
        targets = list(self.detector.observers(core.me, {core.me})) + list(extra)
        return [n for n in dict.fromkeys(targets) if n not in gone]
