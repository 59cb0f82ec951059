"""The agent's answer to a worker's stall: ping the nodes it waits on, suspect the silent ones.

A worker that waits inside a step's communication far longer than its usual step reports a
stall (recovery/stall.py), naming the nodes it waits on when it knows them. Its agent
(control/agent.py) calls `ControlPlane.stalls.probe`: each named node's agent (every member's
when none is named) gets a PING, and a node not heard from within `timeout_s` (STALL_PROBE_S)
is suspected at once -- its agent does not even answer a ping: the node is stopped, frozen or
cut off (the ordinary round follows, as for a kill). A node that answers is left alone, and if
every one answers nothing happens at all: no retry round (unlike the probe after a
communication error, control/plane.py `probe`), because a node slow to arrive in a collective is
a straggler (recovery/straggler.py), not a failure, and replaying its step would not make it
faster. The lease still bounds a wait on a node whose agent answers but whose workers do not
arrive.

A silence means something only if it is one node's while others answer: under a CPU hog the
prober may be the one descheduled, or several agents at once, and a node that suspected all it
pinged would propose a view of itself alone and fence (chaos seed 2818, trial 3; in a CI run
two healthy agents were silent for 0.35 s together and the job fell back). So a stall that
names its suspects also pings up to WITNESSES other members, and a probe suspects a silent
node only if it is the only one and some node answered or was heard from since the ping. A
witness is judged alike: its lone silence is the evidence a probe of every member acts on (chaos
seed 5181, trial 19: a node hung in a recovery's transfer, the stall named the store's host,
which answered, and the hung witness was left to its lease, 3.5 s). Otherwise it suspects
nobody (`unconfirmed` in its event) and leaves the silent nodes to their observers' leases,
which need most observers to agree: two nodes hung at once are found by their leases.

The deadline is the one figure a healthy node's place depends on: a false suspicion costs a
healthy node. It is short next to the lease but long next to a live agent's answer, which the
`stall_probed` event records per node (`answered_s`): `timeout_s` (STALL_PROBE_S), or the lease
over LEASE_SHARE when that is more, or LATE_FACTOR times the longest an agent went unscheduled
in the last half minute when that is more (topology.py, `Lateness`: heartbeats that came late,
this agent's late ticks; the start's are forgotten once the job trains), or the stalled
worker's own threshold when that is more (twice its usual step: a job whose steps crawl waits
that long for a peer before it calls the wait a stall, and a peer's agent silent for less says
no more than the wait itself), at most half the lease. The lease is the user's word on how long
a healthy node of their machine may go unheard, and the probe is its shortcut for one silent
node, so it keeps to a share of it: in two CI runs a healthy node of a job with a 10 s lease
(agents and workers alike) went unheard for 0.4-1 s while a grown node's workers imported torch
at START_NICE, with no lateness before, and a 0.35 s deadline excluded it. On a quiet or busy
machine agents answer in milliseconds and the deadline stays the larger of the first two; on
the 2-core CI machine, while several processes imported torch, probes of three different agents
each found one healthy peer silent past 0.35 s and suspected it. And when the judgement itself
runs late (this agent was descheduled past the deadline: its peers likely too, with their
answers still unsent), the silence proves nothing yet: it is judged again a deadline later. So
too when an answer came slowly: then the pings, the answers or this agent ran slowly, and a
silence counts only once it is SLOW_ANSWER_FACTOR times the slowest answer, at most half the
lease (in a CI run, both witnesses' answers were read 0.315 s after the ping, together, while
the kill of another node woke every process; the pinged node, silent at 0.375 s, was healthy
and lost its place). Under a CPU hog, twice in 12 runs of `bench/recovery.py --modes
crash_under_hog`, a healthy node's agent (with its workers, one scheduling group) was silent
past 0.375 s, 0.38 and 0.43 s, while the job's usual step had grown to 0.37 and 0.45 s
(thresholds 0.74 and 0.90 s): its peers' agents answered in 2-6 ms, and the node lost its
place. A node pinged and not yet answered or timed out is not pinged again (every worker of
every survivor may report the same stall). As the probe after an error, nothing is done for a
stall while a round is open (it explains the stall) or for an older generation.

A round's wait is probed the same way (`round_wait`, from the plane's ticker): a round that has
waited a deadline on members that sent nothing for it -- at its coordinator, the members of its
proposal with no proposal of theirs; at another member, the coordinator -- pings them with the
same witnesses and suspects the one silent node by the same rules, once per proposal. A hung
node found by nobody else would otherwise hold the round for its lease (chaos seed 5173, trial
6: a node exited while another hung at the same step; the round for the exit waited 2.6 s for
the hung member's lease, as its workers' errors were explained by the round). A live member
answers a round in milliseconds, so its silence for two deadlines is the same evidence as a
stalled worker's.

So is an exchange's wait (`exchange_wait`, from the same ticker, once the start is over): an
exchange of the generation (a recovery's reconcile, the end's) that this node's workers gave
their value to and that has waited a deadline -- at the coordinator, on the members whose
values are not in (at most EXCHANGE_PINGS of them); elsewhere, on the coordinator -- pings
them, once per exchange. No round is open then and no collective runs, so neither the round's
probe nor a worker's stall sees a node that hung right after a round decided (chaos seed 5201,
trial 19: node2 stopped 13 ms after it agreed generation 1, and the survivors' reconcile
waited 3 s for its lease). A member still busy answers its ping and is left alone. Not the
commit vote: it waits for every member's step, which under a CPU hog outlasts a deadline, and
the workers' stall watch covers it with the usual step's threshold (recovery/stall.py).
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any

from oobleck_hpc.control.exchange import BOUNDARY

if TYPE_CHECKING:
    from oobleck_hpc.control.plane import ControlPlane

LEASE_SHARE = 8.0
"""A probe waits at least the lease over this (module docstring): 0.375 s for the default 3 s
lease, 1.25 s for a 10 s one."""
LATE_FACTOR = 2.0
"""A probe waits at least this many times the longest lateness seen lately (module docstring)."""
JUDGED_LATE_S = 0.05
"""A judgement that runs this much past its deadline was itself descheduled (module
docstring): it waits one more deadline before it suspects anyone."""
SLOW_ANSWER_FACTOR = 2.0
"""A node is suspected only once silent this many times as long as the slowest answer to the
same probe took (module docstring)."""
EXCHANGE_PINGS = 4
"""An exchange's wait is probed only when it waits on this many nodes at most (module
docstring): one hung node among members still busy with their step is not a silence the probe
can single out."""
WITNESSES = 2
"""Members not named by a stall that its probe pings too: one answer shows that this agent is
heard and hears (module docstring)."""


def reported_threshold(value: Any) -> float:
    """A stall report's `threshold_s` (a worker's message): seconds, 0.0 if absent or not a
    finite positive number."""
    if type(value) in (int, float) and math.isfinite(value) and value > 0:  # (bool excluded)
        return float(value)
    return 0.0


class StallProbes:
    """The stall probes of one agent's control plane (module docstring). Runs under the plane's
    lock; its deadlines on the plane's event loop."""

    def __init__(self, plane: ControlPlane, timeout_s: float):
        self.plane, self.timeout_s = plane, timeout_s
        self._pinged: dict[str, tuple[float, float | None]] = {}
        """Nodes pinged and not yet judged: node -> (pinged at, answered at)."""
        self._round: tuple[int, tuple[str, ...]] | None = None
        """The last round (generation, proposal) whose wait was probed."""
        self._exchanges: dict[tuple[int, str], float | None] = {}
        """This node's waiting exchanges: (generation, key) -> when a tick first saw it wait,
        None once probed."""

    def probe(self, suspects: list[str], why: str, gen: int, threshold_s: float = 0.0) -> None:
        """A worker of this node stalled in generation `gen` waiting on `suspects` (empty: it
        does not know on whom) past its `threshold_s`: ping them, judge them a deadline later
        (`deadline`: at least that threshold, module docstring)."""
        cp = self.plane
        with cp._lock:
            core = cp.core
            if core.fenced or cp._loop is None:
                return
            if gen < core.decided.gen or core.proposal is not None:
                cp.events.emit("probe_skipped", why=why, failed_gen=gen, gen=core.decided.gen,
                               round_open=core.proposal is not None)
                return
            self._ping(suspects, why, in_round=False, threshold_s=threshold_s)

    def tick(self, now: float, round_opened: float | None) -> None:
        """The plane's ticker (its lock held): the open round's wait, opened at `round_opened`,
        and this node's waiting exchanges."""
        self.round_wait(now, round_opened)
        self.exchange_wait(now)

    def round_wait(self, now: float, opened: float | None) -> None:
        """The ticker's look at the open round, opened at `opened` (the plane's lock held):
        once it has waited a deadline on nodes that sent nothing for it, ping them (module
        docstring, a round's wait); once per proposal."""
        core = self.plane.core
        if (core.proposal is None or opened is None or self._round == (core.round, core.proposal)
                or now - opened < self.deadline(now) or self.plane._loop is None):
            return
        waits = core.round_waits_on()
        if waits and self._ping(waits, f"round {core.round} waits on {', '.join(waits)}",
                                in_round=True):
            self._round = (core.round, core.proposal)

    def exchange_wait(self, now: float) -> None:
        """The ticker's look at this node's waiting exchanges (the plane's lock held): one that
        has waited a deadline on nodes pings them (module docstring, an exchange's wait); once
        per exchange, and not before the start is over."""
        cp = self.plane
        gen, waits = cp.core.decided.gen, cp.core.waiting_exchanges()
        for k in [k for k in self._exchanges if k[0] != gen or k[1] not in waits]:
            del self._exchanges[k]
        if cp.monitor.starting or cp._loop is None:
            return
        for key in waits:
            if key.startswith(BOUNDARY):
                continue  # the commit vote (module docstring)
            since = self._exchanges.setdefault((gen, key), now)
            if since is None or now - since < self.deadline(now):
                continue
            nodes = cp.core.exchange_waits_on(key)
            if 0 < len(nodes) <= EXCHANGE_PINGS and self._ping(
                    nodes, f"exchange {key} waits on {', '.join(nodes)}", in_round=False):
                self._exchanges[(gen, key)] = None

    def _ping(self, suspects: list[str], why: str, in_round: bool,
              threshold_s: float = 0.0) -> bool:
        """Ping `suspects` (all live nodes if empty) and witnesses; whether a node of
        `suspects` was pinged (one pinged already and not yet judged is not: its judgement
        comes first, and a round's wait is looked at again at the next tick)."""
        cp, core = self.plane, self.plane.core
        gone = core.suspects.keys() | core.left | self._pinged.keys()
        live = [n for n in core.decided.nodes + core.round_joiners if n != cp.me and n not in gone]
        nodes = [n for n in suspects or live if n in live]
        witnesses = [n for n in live if n not in nodes][:WITNESSES]
        now = time.monotonic()
        for node in nodes + witnesses:
            self._pinged[node] = (now, None)
            cp._link(node).put({"type": "ping"})
        if nodes and cp._loop is not None:
            deadline = self.deadline(now, threshold_s)
            cp._loop.after(deadline, functools.partial(
                self._judge, nodes, witnesses, now, now + deadline, core.decided.gen, why,
                in_round, threshold_s))
        return bool(nodes)

    def deadline(self, now: float, threshold_s: float = 0.0) -> float:
        """How long a probe started now for a stall of `threshold_s` waits for answers (module
        docstring)."""
        cp = self.plane
        late = LATE_FACTOR * cp.monitor.lateness.recent(now)
        return max(self.timeout_s, cp.lease_s / LEASE_SHARE,
                   min(max(late, threshold_s), cp.lease_s / 2))

    def heard(self, src: str, msg: dict[str, Any]) -> None:
        """A message from `src` (called with the plane's lock held): a PONG answers its ping."""
        if msg.get("type") == "pong" and self._pinged.get(src, (0.0, 0.0))[1] is None:
            self._pinged[src] = (self._pinged[src][0], time.monotonic())

    def _later(self, pinged: list[str], started: float, due: float, now: float,
               threshold_s: float) -> float | None:
        """When a judgement due at `due` and running `now` must be made again instead (module
        docstring), or None: this agent ran late, or an answer came slowly."""
        cp = self.plane
        if now - due > JUDGED_LATE_S:  # this agent was not running
            cp.monitor.lateness.note(now, now - due)
            later = now + self.deadline(now, threshold_s)
            return later if later - started <= cp.lease_s else None  # (past, the leases decide)
        slowest = max((t - started for n in pinged
                       if (t := self._pinged.get(n, (0.0, None))[1]) is not None), default=0.0)
        later = started + min(SLOW_ANSWER_FACTOR * slowest, cp.lease_s / 2)
        return later if later > now + 0.001 else None

    def _judge(self, nodes: list[str], witnesses: list[str], started: float, due: float,
               gen: int, why: str, in_round: bool, threshold_s: float) -> None:
        """At `due`, a deadline after `nodes` and `witnesses` were pinged: suspect the one node
        not heard from since, if another was (module docstring). `in_round`: pinged for an
        open round's wait, which must still be open (else for a stall: none may be)."""
        cp = self.plane
        with cp._lock:
            now = time.monotonic()
            later = self._later(nodes + witnesses, started, due, now, threshold_s)
            if later is not None and cp._loop is not None:
                cp._loop.after(later - now, functools.partial(
                    self._judge, nodes, witnesses, started, later, gen, why, in_round,
                    threshold_s))
                return
            answered = {n: self._pinged.pop(n, (started, None))[1] for n in nodes + witnesses}
            core = cp.core
            if core.fenced or core.decided.gen != gen or (core.proposal is not None) != in_round:
                return  # a round or a decision came first: it answers for the stall
            heard = {n for n in core.decided.nodes + core.round_joiners if n != cp.me and (
                answered.get(n) is not None or cp.detector.last_heard.get(n, 0.0) >= started)}
            silent = [n for n in nodes + witnesses if n not in heard and n not in core.suspects]
            unconfirmed = not heard or len(silent) > 1
            cp.events.emit("stall_probed", why=why, nodes=nodes, silent=silent,
                           witnesses=witnesses, unconfirmed=unconfirmed,
                           timeout_s=round(due - started, 4),
                           answered_s={n: round(t - started, 4) for n, t in answered.items()
                                       if t is not None})
            if unconfirmed:
                return
            for node in silent:
                cp._run(functools.partial(core.suspect, node, f"stall_probe_unanswered (within "
                                          f"{due - started:.2f} s)"))
