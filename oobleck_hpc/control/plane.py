"""The control plane: plain TCP between node agents, driving the membership protocol.

`ControlPlane` runs the pure `MembershipCore` (membership.py, which documents the protocol) over
sockets, with stdlib only. Per agent:

- one event loop thread (loop.py) for all its sockets and timers: the listening socket on the
  agent's roster port, the accepted connections, the outgoing links, and the ticker. What
  arrives is handed to the core under one lock (the core is single-threaded by construction);
  nothing ever blocks the core: sends are queued and written by the loop.
- the listening socket is bound to the interface of this node's roster address (not every
  interface). A connection proves the run's secret (auth.py): its first frame is a HELLO {src,
  to, host, port, nonce, ts} sealed with keys derived from the secret, and every frame after it,
  both ways, carries a MAC bound to the sender's name and its place on that connection; a frame
  that does not verify or validate (messages.py) closes its connection (inbound.py). A verified
  HELLO from a node outside the roster adds it (with a link to its address): a node grown into
  the running job (it read the run's secret), which joins like a spare. What the core
  addressed to it before (a peer's round that adds it reached this agent first) is sent then.
- one outgoing link per peer it sends to, opened on the first message (lazily), retried until
  `startup_s` has passed for a peer never reached. Links to nodes that are not this agent's
  observers close after `IDLE_CLOSE_S` idle (loop.py), or at once after use in a job larger than
  links.OUT_CAP, so that in steady state an agent holds links only along its monitoring edges
  (topology.py), and never more than links.OUT_CAP outgoing and inbound.IN_CAP accepted
  connections. A failed send is retried on a fresh connection (links.py) before it becomes a
  suspicion, so one flaky TCP connection does not exclude a healthy peer; a refused connection
  ends the retries at once (nobody listens on the peer's port: its agent is gone).
- an inbound connection that ends without UNLINK is checked the same way before it counts (in
  a short helper thread): the peer's listening port is tried; if it accepts, the peer is alive
  and will reconnect.
- the ticker, every heartbeat_s / 2: heartbeats, leases, probes, the agreement timeout, this
  agent's own scheduling (see below), and a spare's repeated JOIN.

Who watches whom (topology.py): K rings over the decided view; an agent heartbeats its (at
most K) observers and holds leases on its (at most K) subjects, and a lease expiry becomes a
suspicion only when most of the subject's observers report it (REPORT messages among them). A
round's joiners and the members watch each other directly while the round is open.

What each timeout bounds
------------------------
- heartbeat_s: how often an agent sends HEARTBEAT to its observers (and checks leases, and
  its own scheduling: a pause of its own does not count against its subjects; topology.py).
- lease_s: longest silence of a subject before its observer reports it; bounds detection of
  hangs and partitions (crashes are seen at once through the dropped connection). Also bounds
  how long a round waits for an unresponsive member (the stall probe's rules find a silent one
  sooner). Every edge starts with a fresh lease.
  Until this node's workers are past their start (`started`, `open_joins`), the lease is
  START_LEASE_FACTOR x lease_s (topology.py: imports starve agents).
- probe_s: after a worker reports a communication error without naming a peer, every peer not
  heard from within probe_s of a PING is suspected (faster than the lease for hung nodes); if
  every peer answered, the agent opens a retry round (4b). Not while a round is open: the round
  explains the error, and the stall probe's rules bound its wait for a hung member.
- stall_probe_s (configs/resilience.py, STALL_PROBE_S): after a worker reports a stall (a wait
  inside a step far longer than its usual step: recovery/stall.py), the nodes it waits on (every
  member when it does not know) are pinged, and those not heard from within stall_probe_s (or
  longer: the stall's own threshold when the job's steps crawl, a share of the lease, recent
  lateness: control/stall_probe.py) are suspected if it is the only one and another node
  answered (several silent at once, or none answering, is more likely a starved machine or
  prober): a hung node is lost in band, long before its lease. If every one answered, nothing
  happens (no retry round: a slow node is a straggler, not a failure; the lease remains the
  backstop). Short, but far above a live agent's answer on a loaded machine (the
  `stall_probed` event records each answer's delay). The same for a round that waits on nodes
  that sent nothing for it. `stalls` (control/stall_probe.py).
- agreement_timeout_s (default 2 * lease_s): longest time an open round may go with an unchanged
  proposal and no decision (its own pauses excused: topology.py); an agent that hits it
  fences itself for a requeue (never hang).
- startup_s: how long agents wait for each other's first connection at start.

Detection sources, fastest first: a connection closed by the peer's kernel when its agent died
(milliseconds; "connection_lost"), a failed send ("send_failed"), a FAILED message from a peer
whose worker crashed, a BYE of a node that leaves early, a worker's report naming a peer, a ping
unanswered after a worker's stall (stall_probe_s: a hung node, found in band), a probe after a
worker's unexplained communication error (probe_s), and the lease (lease_s) for hung nodes that
no worker waits on, and partitions. A probe (not a stall's) that every peer answers opens a retry
round instead (the failure was not a lost node: the workers rebuild their groups on the same
nodes; membership.py, 4b).

Every note of the core becomes an event in the run's event log (see events.py) and is passed on
to the owner (the agent) through `on_note(kind, fields)`, called with the lock held: the callback
must only queue work.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import Any, Callable

from oobleck_hpc.config import HEARTBEAT_S, LEASE_S, STALL_PROBE_S, STARTUP_S
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.control.links import OUT_CAP, Link, reach
from oobleck_hpc.control.loop import EventLoop
from oobleck_hpc.control.membership import Decision, LeaveKind, MembershipCore, Quorum
from oobleck_hpc.control.stall_probe import StallProbes
from oobleck_hpc.control.topology import MONITORS, START_LEASE_FACTOR, Monitor
from oobleck_hpc.control.wire import NodeAddress, Roster, free_port
from oobleck_hpc.polling import wait_until

UNKNOWN_KEPT = 64
"""Messages kept for one node whose address is not known yet: a node grown into the job that a
peer's round adds before its own HELLO reaches this agent (the round's coordinator must still
tell it: it is the only one that does)."""
HOLD_S = 0.01
"""How long a coordinator holds the first re-broadcast of its changed proposal in a round (then
twice as long each time, at most lease_s / 2), so that suspicions arriving together or in a
stream (a switch, a partition) cost a few broadcasts to every member, not one each
(membership.py: hold_rebroadcasts). A round's first broadcast is not held."""
JOIN_HOLD_S = 2.0
"""The longest a round that only adds joiners waits for a step boundary (membership.py, 7b):
a job that commits no step meanwhile (its start, a recovery, a long checkpoint save, a test's
echo workers) takes its joiners then, at the cost of a replayed step."""
REJECTS_LOGGED = 100
"""Rejected frames recorded as events one by one (then every 1000th): a flood of garbage does
not fill the run's event log."""


class ControlPlane:
    """One agent's end of the control plane (see module docstring)."""

    def __init__(self, me: str, roster: Roster, *, secret: bytes,
                 heartbeat_s: float = HEARTBEAT_S, lease_s: float = LEASE_S,
                 probe_s: float | None = None, agreement_timeout_s: float | None = None,
                 startup_s: float = STARTUP_S, quorum: Quorum = "majority",
                 open_to_joins: bool = True, joins_at_boundary: bool = False,
                 monitors: int = MONITORS,
                 events: EventLog | None = None, stall_probe_s: float = STALL_PROBE_S,
                 on_note: Callable[[str, dict[str, Any]], None] | None = None):
        if lease_s <= heartbeat_s:
            raise ValueError(f"lease_s={lease_s} must exceed heartbeat_s={heartbeat_s}")
        self.me = me
        self.secret = secret
        """The run's secret (auth.py): every connection proves it."""
        self.roster = roster
        self.addr = roster.address(me)
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.probe_s = probe_s if probe_s is not None else max(2 * heartbeat_s, lease_s / 3)
        self.stalls = StallProbes(self, stall_probe_s)  # (control/stall_probe.py)
        self.agreement_timeout_s = agreement_timeout_s or 2 * lease_s
        self.startup_s = startup_s
        self.events = events or EventLog(None, source=me)
        self.on_note = on_note or (lambda kind, fields: None)
        self.core = MembershipCore(me, roster.names, roster.store_port,
                                   lambda: free_port(self.addr.host), quorum,
                                   members0=roster.members0, open_to_joins=open_to_joins,
                                   joins_at_boundary=joins_at_boundary,
                                   hold_rebroadcasts=True)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._loop: EventLoop | None = None
        self._links: dict[str, Link] = {}
        self._unknown: dict[str, list[dict[str, Any]]] = {}
        """Messages to grown nodes whose HELLO has not arrived yet (a peer's PROPOSE added one)."""
        self.monitor = Monitor(self.core, heartbeat_s, lease_s, startup_s, monitors,
                               self.agreement_timeout_s, emit=self.events.emit,
                               start_lease_s=START_LEASE_FACTOR * lease_s)
        self.detector = self.monitor.detector
        self.rejected = 0
        """Frames rejected (connections closed for them): inbound.py, links.py, `_frame_rejected`."""
        self.sent = self.received = 0
        """Messages sent and received (HELLOs included): the control plane's load."""
        self._t0 = time.monotonic()
        self._round_t: dict[int, float] = {}
        self._joins_held = 0.0  # since when the core holds a round for joiners (JOIN_HOLD_S)
        self._probe: tuple[float, float, int, str] | None = None  # started, deadline, gen, why
        self._join_how: str | None = None
        self._join_asked = 0.0
        self._flush_due = False  # a held re-broadcast of the core is to be sent (HOLD_S)

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Open the listening socket (separately from start(), so that a busy port is reported
        before any worker is spawned)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.addr.host, self.addr.port))
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"agent {self.me}: cannot listen on {self.addr.host}:"
                          f"{self.addr.port} ({e.strerror}); the roster gives this address: "
                          f"pick a free port on an interface of this host") from e
        sock.listen(4096)  # a round's messages from every member wait here (inbound.py: IN_CAP)
        self._loop = EventLoop(self, sock)
        self._links = self._loop.connector.links

    def start(self) -> None:
        if self._loop is None:
            self.bind()
        assert self._loop is not None
        self._t0 = time.monotonic()
        self.monitor.start(self._t0)
        self._loop.after(self.heartbeat_s / 2, self._tick)
        self._loop.start()

    def close(self) -> None:
        """Stop: every socket closes at once (what is queued is not sent: flush() first)."""
        self._stop.set()
        if self._loop is not None:
            if self._loop.thread.is_alive():
                self._loop.stop()
            else:
                self._loop._close_all()

    def flush(self, timeout: float = 1.0) -> None:
        """Wait (bounded) until queued messages have been handed to the kernel."""

        def drained() -> bool:
            with self._lock:
                return all(link.drained for link in self._links.values())

        try:
            wait_until(drained, timeout, "queued messages to be written", every_s=0.005)
        except TimeoutError:
            pass  # best effort: what a dead peer's link holds is lost with the agent anyway

    # ------------------------------------------------------------------ owner's API

    @property
    def decided(self) -> Decision:
        return self.core.decided

    @property
    def fenced(self) -> str | None:
        return self.core.fenced

    def suspect(self, node: str, how: str) -> None:
        self._run(lambda: self.core.suspect(node, how))

    def fail_self(self, how: str) -> None:
        self._run(lambda: self.core.fail_self(how))

    def leave(self, how: LeaveKind, code: int, reason: str = "") -> None:
        self._run(lambda: self.core.leave(how, code, reason))

    def drain_out(self, nodes: list[str]) -> None:  # (membership.py, 4e)
        self._run(lambda: self.core.drain_out(nodes))

    def withdraw(self, reason: str) -> None:
        """This node steps out while its agent lives (membership.py, 4d); it asks to join again
        (`request_join`) once its new workers are ready, not before (a round would wait)."""
        with self._lock:
            self._join_how = None
            self._run(lambda: self.core.withdraw(reason))

    def exchange(self, key: str, value: Any, gen: int | None = None) -> None:
        self._run(lambda: self.core.exchange(key, value, gen))

    def request_join(self, how: str) -> None:
        """A spare (or replacement) asks every other roster node to add it (non-members ignore
        it), and asks again every lease_s until it is in: a member that did not hear it (not up
        yet, or a spare itself then) hears the next one."""
        with self._lock:
            self._join_how = how
            self._join_asked = time.monotonic()
            self._run(lambda: self.core.request_join(
                how, to=[n for n in self.roster.names if n != self.me]))

    def open_joins(self) -> None:
        """The job trains: add joiners from now on (membership.py, step 7); the start is over
        (topology.py, `Monitor.trains`)."""
        with self._lock:
            self.monitor.trains()
            self._run(self.core.open_joins)

    def started(self) -> None:
        """Every rank of the start built its engine (topology.py, `Monitor.started`)."""
        with self._lock:
            self.monitor.started()

    def check(self, node: str, why: str, gen: int | None = None) -> None:
        """A worker named `node` as the peer whose connection broke. Suspect it if its agent
        is gone too (a dead node's port refuses at once), else probe: its agent lives (e.g. its
        worker crashed and the node steps out: its BYE follows) and a retry round follows if
        nothing else does. One short thread."""
        def run() -> None:
            a = self.roster.address(node)
            if reach(a.host, a.port, timeout=min(1.0, self.lease_s / 3), stop=self._stop):
                self.suspect(node, why)
            else:
                self.probe(why, gen)

        threading.Thread(target=run, name="control-check", daemon=True).start()

    def probe(self, why: str, gen: int | None = None) -> None:
        """Ping every member now; those not heard from within probe_s are suspected; if all
        answer, a retry round opens. `gen`: the failure's generation (an older one is ignored:
        the newer one gave the workers fresh groups). Not while a round is open (a running
        probe is dropped): the round explains the error (a join's aborts every step) and waits
        for its members at most lease_s, so a hung member is still found; a probe would only
        suspect a healthy member slow to answer while the job reconfigures (seen: a member
        lost in a grow's round on a loaded 2-core machine)."""
        with self._lock:
            if self.core.fenced:
                return
            current = self.core.decided.gen
            if (gen is not None and gen < current) or self.core.proposal is not None:
                self.events.emit("probe_skipped", why=why, failed_gen=gen, gen=current,
                                 round_open=self.core.proposal is not None)
                return
            if self._probe is not None:
                return  # one probe at a time: the running one answers for this failure too
            now = time.monotonic()
            self._probe = (now, now + self.probe_s, current, why)
            self.events.emit("probe", why=why, timeout_s=self.probe_s)
            for node in self.core.decided.nodes:
                if node != self.me:
                    self._link(node).put({"type": "ping"})

    def resources(self, peak: bool = False) -> dict[str, int]:
        """What this agent's control plane holds open now (`peak`: the most it held at once):
        sockets (listener, the event loop's wake-up pair, links, accepted connections) and
        threads (the event loop; helpers checking a lost connection)."""
        with self._lock:
            if self._loop is None:
                return {"sockets": 0, "strangers": 0, "threads": 0}
            return dict(self._loop.peak) if peak else self._loop.resources()

    def store_host(self, node: str) -> str:
        return self.roster.address(node).host

    # ------------------------------------------------------------------ internals

    def _deliver(self, src: str, msg: dict[str, Any]) -> None:
        """A message to the monitor (heartbeats, probes), or else to the membership core."""
        if not self.monitor.message(src, msg, time.monotonic()):
            self.core.handle(src, msg)

    def _run(self, fn: Callable[[], object]) -> None:
        """Call into the core and flush what it produced (messages, notes) under the lock."""
        with self._lock:
            fn()
            for dst, msg in self.core.outbox:
                if dst in self.roster:
                    self._link(dst).put(msg)
                elif len(self._unknown.setdefault(dst, [])) < UNKNOWN_KEPT:
                    self._unknown[dst].append(msg)  # sent once its address is known (_known)
            self.core.outbox.clear()
            if self.core.held and not self._flush_due and self._loop is not None:
                self._flush_due = True
                self._loop.after(self.core.hold_delay(HOLD_S, self.lease_s / 2), self._flush)
            notes, self.core.notes = self.core.notes, []
            for kind, fields in notes:
                self._note(kind, fields)

    def _flush(self) -> None:
        self._flush_due = False
        self._run(self.core.flush)

    def _note(self, kind: str, fields: dict[str, Any]) -> None:
        now = time.monotonic()
        if kind == "suspect":
            self.events.emit("failure_detected", node=fields["node"], how=fields["how"],
                             gen=fields["gen"])
        elif kind == "round_started":
            self._round_t[fields["gen"]] = now
            self._probe = None  # the round answers for the error that started it (probe())
            self.events.emit("round_started", gen=fields["gen"], suspects=sorted(fields["suspects"]),
                             joiners=fields["joiners"])
        elif kind == "decided":
            started = self._round_t.pop(fields["gen"], None)
            self.events.emit("agreement_reached", gen=fields["gen"], nodes=fields["nodes"],
                             lost=fields["lost"], joined=fields["joined"],
                             store_node=fields["store_node"],
                             store_addr=f"{self.store_host(fields['store_node'])}:{fields['store_port']}",
                             how=fields["how"],
                             round_s=None if started is None else round(now - started, 4))
        elif kind == "fenced":
            self.events.emit("fenced", reason=fields["reason"], gen=fields["gen"],
                             code=fields["code"])
        elif kind == "joins_held":
            self._joins_held = now
        elif kind in ("join_requested", "join_request"):
            self.events.emit(kind, node=fields["node"], gen=fields["gen"], how=fields["how"])
        elif kind == "peer_left":
            self.events.emit("peer_left", node=fields["node"], code=fields["code"])
        elif kind == "retry":
            self.events.emit("retry_round", gen=fields["gen"], why=fields["why"])
        elif kind == "exchange_failed":
            self.events.emit("exchange_failed", key=fields["key"], gen=fields["gen"],
                             reason=fields["reason"])
        self.on_note(kind, fields)

    def _link(self, peer: str) -> Link:
        """The outgoing link to `peer`, opened now if there is none (call with the lock held)."""
        assert self._loop is not None, "bind() or start() first"
        addr = self.roster.address(peer)
        return self._loop.connector.link(peer, (addr.host, addr.port))

    def _on_message(self, src: str, msg: dict[str, Any]) -> None:
        with self._lock:
            self.received += 1
            if msg.get("type") == "ping":
                self._link(src).put({"type": "pong"})
                self.on_note("pinged", {"node": src})  # (a peer waits on this node: agent.py)
            self.stalls.heard(src, msg)
            self._run(functools.partial(self._deliver, src, msg))

    def _link_failed(self, peer: str, how: str) -> None:
        with self._lock:
            if self._stop.is_set() or peer in self.core.left:
                return
        self.suspect(peer, how)

    def _connection_lost(self, peer: str) -> None:
        """An inbound connection from `peer` ended: a failure only if its agent no longer
        listens (a flaky connection is reopened by the peer's sender)."""
        error = reach(self.roster.address(peer).host, self.roster.address(peer).port,
                      timeout=min(1.0, self.lease_s / 3), stop=self._stop)
        if error is None:
            self.events.emit("connection_reopened", node=peer)
            return
        self._link_failed(peer, "connection_lost")

    def _frame_rejected(self, src: str | None, peer: str, reason: str) -> None:
        """The event loop closed a connection whose frame could not be acted on (inbound.py,
        links.py).
        Recorded, but not every one of a flood: the first REJECTS_LOGGED, then every 1000th."""
        self.rejected += 1
        if self.rejected <= REJECTS_LOGGED or self.rejected % 1000 == 0:
            self.events.emit("frame_rejected", node=src, peer=peer, reason=reason[:200],
                             count=self.rejected)

    def _loop_died(self, error: BaseException) -> None:
        """The event loop thread ends on an exception (a bug): this node can no longer hear or
        tell its peers, so it fences itself at once -- its agent exits, and its peers see its
        connections close and its port refuse (a clean loss) instead of an agent lingering
        until its lease runs out."""
        self.events.emit("control_loop_died", error=f"{type(error).__name__}: {error}"[:300])
        self._run(lambda: self.core.fence(f"control plane event loop died "
                                          f"({type(error).__name__}: {error})"))

    def _known(self, src: Any, hello: dict[str, Any]) -> bool:
        """Whether `src` is a roster node; a node outside it that gives its address is added
        (grown into the running job; module docstring)."""
        host, port = hello.get("host"), hello.get("port")
        with self._lock:
            if src in self.roster:
                return True
            if not (isinstance(src, str) and isinstance(host, str) and isinstance(port, int)):
                return False
            self.roster = self.roster.with_node(NodeAddress(src, host, port))
            self.core.add_node(src)
            for msg in self._unknown.pop(src, []):
                self._link(src).put(msg)
        self.events.emit("peer_added", node=src, addr=f"{host}:{port}")
        return True

    def _tick(self) -> None:
        """Every heartbeat_s / 2, on the event loop: heartbeats, leases, own scheduling (the
        Monitor), links kept or closed, a spare's repeated JOIN, a probe's deadline."""
        now = time.monotonic()
        assert self._loop is not None
        targets: list[str] = []
        self._run(lambda: targets.extend(self.monitor.tick(now)))
        if self.core.fenced:
            return  # no more ticks: its peers stop hearing from it
        self._loop.after(self.heartbeat_s / 2, self._tick)
        self._loop.pin(targets, now, one_shot=len(self.core.decided.nodes) > OUT_CAP)
        if (self._join_how is not None and not self.core.joined
                and now - self._join_asked >= self.lease_s):
            self.request_join(self._join_how)
        if self.core.joins_held and now - self._joins_held >= JOIN_HOLD_S:
            self._run(self.core.take_joiners)  # no step commits: take the joiners now
        self._run(lambda: self.stalls.tick(now, self._round_t.get(self.core.round)))
        if self._probe is not None and now >= self._probe[1]:
            started, _, gen, why = self._probe
            self._probe = None
            silent = [n for n in self.core.decided.nodes + self.core.round_joiners if n != self.me
                      and n not in self.core.suspects and n not in self.core.left
                      and self.detector.last_heard.get(n, 0.0) < started]
            for node in silent:
                self._run(functools.partial(self.core.suspect, node,
                                            f"probe_unanswered (within probe_s={self.probe_s})"))
            if not silent and self.core.decided.gen == gen:
                self._run(lambda: self.core.retry(f"every peer answered the probe "
                                                  f"after: {why}"))

