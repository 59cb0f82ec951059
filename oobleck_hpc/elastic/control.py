"""The control plane: plain TCP between node agents, driving the membership protocol.

`ControlPlane` runs the pure `MembershipCore` (membership.py, which documents the protocol) over
sockets, with stdlib only. Per agent:

- one listening socket on the agent's roster port; every accepted connection gets a reader
  thread. The first message on a connection is HELLO {src, host, port}; after that every message
  is handed to the core under one lock (the core is single-threaded by construction). A HELLO
  from a node outside the roster adds it (with a link to its address): a node grown into the
  running job, which joins like a spare. What the core addressed to it before (a peer's round
  that adds it reached this agent first) is sent then.
- one outgoing link per peer it sends to, opened on the first message (lazily): a queue and a
  sender thread that connects (retrying until `startup_s` has passed for a peer never
  reached), sends HELLO, then the queued messages. Nothing ever blocks the core: sends are
  queued. A link that has been idle for `IDLE_CLOSE_S` to a node that is not one of this
  agent's observers is closed (after an UNLINK that tells the reader to end quietly), so that
  the links a membership round opened to every member do not stay: in steady state an agent
  holds links only along its monitoring edges (topology.py). A failed send is retried on a
  fresh connection (links.py: `SEND_ATTEMPTS` tries, `RETRY_PAUSE_S` apart) before it becomes
  a suspicion, so one flaky TCP connection does not exclude a healthy peer; a refused
  connection ends the retries at once (nobody listens on the peer's port: its agent is gone).
- an inbound connection that ends is checked the same way before it counts: the peer's
  listening port is tried; if it accepts, the peer is alive and will reconnect.
- one ticker thread, every heartbeat_s / 2: heartbeats, leases, probes, the agreement timeout,
  and this agent's own scheduling (see below), and a spare's repeated JOIN.

Who watches whom (topology.py): K rings over the decided view; an agent heartbeats its (at
most K) observers and holds leases on its (at most K) subjects, and a lease expiry becomes a
suspicion only when most of the subject's observers report it (REPORT messages among them). A
round's joiners and the members watch each other directly while the round is open.

What each timeout bounds
------------------------
- heartbeat_s: how often an agent sends HEARTBEAT to its observers (and checks leases and its
  own scheduling: a ticker that was not scheduled for more than lease_s fences its node -- it
  was stopped, its peers have excluded it by now, so it must not act on its old view).
- lease_s: longest silence of a subject before its observer reports it; bounds detection of
  hangs and partitions (crashes are seen at once through the dropped connection). Also bounds
  how long a round waits for an unresponsive member. Every edge starts with a fresh lease.
- probe_s: after a worker reports a communication error without naming a peer, every peer not
  heard from within probe_s of a PING is suspected (faster than the lease for hung nodes); if
  every peer answered, the agent opens a retry round (4b). Not while a round is open: the round
  explains the error, and the lease bounds its wait for a hung member.
- agreement_timeout_s (default 2 * lease_s): longest time an open round may go with an unchanged
  proposal and no decision; an agent that hits it fences itself for a requeue (never hang).
- startup_s: how long agents wait for each other's first connection at start.

Detection sources, fastest first: a connection closed by the peer's kernel when its agent died
(milliseconds; "connection_lost"), a failed send ("send_failed"), a FAILED message from a peer
whose worker crashed, a BYE of a node that leaves early, a worker's report naming a peer, a probe
after a worker's unexplained communication error (probe_s), and the lease (lease_s) for hung
nodes and partitions. A probe that every peer answers opens a retry round instead (the failure
was not a lost node: the workers rebuild their groups on the same nodes; membership.py, 4b).

Every note of the core becomes an event in the run's event log (see events.py) and is passed on
to the owner (the agent) through `on_note(kind, fields)`, called with the lock held: the callback
must only queue work.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

from oobleck_hpc.elastic.events import EventLog
from oobleck_hpc.elastic.links import Link, reach
from oobleck_hpc.elastic.membership import Decision, LeaveKind, MembershipCore, Quorum
from oobleck_hpc.elastic.topology import MONITORS, Monitor
from oobleck_hpc.elastic.wire import ConnectionClosed, NodeAddress, Roster, free_port, recv_msg

UNKNOWN_KEPT = 64
"""Messages kept for one node whose address is not known yet: a node grown into the job that a
peer's round adds before its own HELLO reaches this agent (the round's coordinator must still
tell it: it is the only one that does)."""
IDLE_CLOSE_S = 10.0
"""An outgoing link idle for this long to a node that is not an observer of this agent is
closed (a round's messages to every member opened it)."""


class ControlPlane:
    """One agent's end of the control plane (see module docstring)."""

    def __init__(self, me: str, roster: Roster, *, heartbeat_s: float = 0.5, lease_s: float = 3.0,
                 probe_s: float | None = None, agreement_timeout_s: float | None = None,
                 startup_s: float = 60.0, quorum: Quorum = "majority",
                 open_to_joins: bool = True, monitors: int = MONITORS,
                 events: EventLog | None = None,
                 on_note: Callable[[str, dict[str, Any]], None] | None = None):
        if lease_s <= heartbeat_s:
            raise ValueError(f"lease_s={lease_s} must exceed heartbeat_s={heartbeat_s}")
        self.me = me
        self.roster = roster
        self.addr = roster.address(me)
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.probe_s = probe_s if probe_s is not None else max(2 * heartbeat_s, lease_s / 3)
        self.agreement_timeout_s = agreement_timeout_s or 2 * lease_s
        self.startup_s = startup_s
        self.events = events or EventLog(None, source=me)
        self.on_note = on_note or (lambda kind, fields: None)
        self.core = MembershipCore(me, roster.names, roster.store_port,
                                   lambda: free_port(self.addr.host), quorum,
                                   members0=roster.members0, open_to_joins=open_to_joins)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._links: dict[str, Link] = {}
        self._unknown: dict[str, list[dict[str, Any]]] = {}
        """Messages to grown nodes whose HELLO has not arrived yet (a peer's PROPOSE added one)."""
        self.monitor = Monitor(self.core, heartbeat_s, lease_s, startup_s, monitors,
                               self.agreement_timeout_s, emit=self.events.emit)
        self.detector = self.monitor.detector
        self.sent = self.received = 0
        """Messages sent and received (HELLOs included): the control plane's load."""
        self._t0 = time.monotonic()
        self._round_t: dict[int, float] = {}
        self._probe: tuple[float, float, int, str] | None = None  # started, deadline, gen, why
        self._join_how: str | None = None
        self._join_asked = 0.0
        self._threads: list[threading.Thread] = []
        self._inbound: list[socket.socket] = []

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Open the listening socket (separately from start(), so that a busy port is reported
        before any worker is spawned)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", self.addr.port))
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"agent {self.me}: cannot listen on port {self.addr.port} "
                          f"({e.strerror}); the roster gives this port, pick a free one") from e
        sock.listen(128)
        self._listener = sock

    def start(self) -> None:
        if self._listener is None:
            self.bind()
        self._t0 = time.monotonic()
        self.monitor.start(self._t0)
        self._spawn(self._accept_loop, "accept")
        self._spawn(self._tick_loop, "ticker")

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            try:  # shutdown wakes the accept() of the accept thread; close alone would not
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self._listener.close()
            except OSError:
                pass
        for link in list(self._links.values()):
            link.close()
        for sock in self._inbound:
            try:
                sock.close()
            except OSError:
                pass

    def flush(self, timeout: float = 1.0) -> None:
        """Wait (bounded) until queued messages have been handed to the kernel."""
        deadline = time.monotonic() + timeout
        for link in list(self._links.values()):
            link.drained.wait(max(0.0, deadline - time.monotonic()))

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
        """The job trains: add joiners from now on (membership.py, step 7)."""
        self._run(self.core.open_joins)

    def probe(self, why: str, gen: int | None = None) -> None:
        """Ping every member now; those not heard from within probe_s are suspected. If every
        member answers, a retry round opens. `gen`: the generation the failure happened in; a
        failure of an older generation is ignored (the newer generation already gave the
        workers fresh groups). A probe is not started, and one running is dropped, while a
        round is open: the round explains the error (it aborted the step everywhere: a join's
        round makes every worker report one), and it waits for its members at most lease_s,
        so a hung member is still found. Probing then would only suspect a healthy member
        slower than probe_s to answer while the whole job reconfigures (seen: a member lost
        in a grow's round on a loaded 2-core machine)."""
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

    def resources(self) -> dict[str, int]:
        """What this agent's control plane holds open now: sockets (listener, links,
        accepted connections) and threads."""
        with self._lock:
            links = [link for link in self._links.values() if link.thread.is_alive()]
            inbound = [s for s in self._inbound if s.fileno() != -1]
            threads = [t for t in self._threads if t.is_alive()]
            return {"sockets": (self._listener is not None) + len(links) + len(inbound),
                    "threads": len(threads) + len(links)}

    def store_host(self, node: str) -> str:
        return self.roster.address(node).host

    # ------------------------------------------------------------------ internals

    def _spawn(self, fn: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, name=f"cp-{self.me}-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _run(self, fn: Callable[[], None]) -> None:
        """Call into the core and flush what it produced (messages, notes) under the lock."""
        with self._lock:
            fn()
            for dst, msg in self.core.outbox:
                if dst in self.roster.names:
                    self._link(dst).put(msg)
                elif len(self._unknown.setdefault(dst, [])) < UNKNOWN_KEPT:
                    self._unknown[dst].append(msg)  # sent once its address is known (_known)
            self.core.outbox.clear()
            notes, self.core.notes = self.core.notes, []
            for kind, fields in notes:
                self._note(kind, fields)

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
        link = self._links.get(peer)
        if link is None:
            addr = self.roster.address(peer)
            link = self._links[peer] = Link(self, peer, (addr.host, addr.port))
            link.start()
        return link

    def _on_message(self, src: str, msg: dict[str, Any]) -> None:
        with self._lock:
            self.received += 1
            if msg.get("type") == "ping":
                self._link(src).put({"type": "pong"})
            self._run(lambda: self.monitor.message(src, msg, time.monotonic())
                      or self.core.handle(src, msg))

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

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._inbound = [s for s in self._inbound if s.fileno() != -1] + [sock]
                self._threads = [t for t in self._threads if t.is_alive()]
            self._spawn(self._read_loop, "reader", sock)

    def _read_loop(self, sock: socket.socket) -> None:
        src = None
        try:
            hello = recv_msg(sock)
            src = hello.get("src")
            if hello.get("type") != "hello" or src == self.me or not self._known(src, hello):
                return
            self._on_message(src, hello)
            while not self._stop.is_set():
                msg = recv_msg(sock)
                if msg.get("type") == "unlink":
                    return  # the sender closed an idle link; it opens a new one when needed
                self._on_message(src, msg)
        except (ConnectionClosed, OSError, ValueError):
            if src is not None and not self._stop.is_set():
                self._connection_lost(src)
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def _known(self, src: Any, hello: dict[str, Any]) -> bool:
        """Whether `src` is a roster node; a node outside it that gives its address is added
        (grown into the running job; module docstring)."""
        host, port = hello.get("host"), hello.get("port")
        with self._lock:
            if src in self.roster.names:
                return True
            if not (isinstance(src, str) and isinstance(host, str) and isinstance(port, int)):
                return False
            self.roster = self.roster.with_node(NodeAddress(src, host, port))
            self.core.add_node(src)
            for msg in self._unknown.pop(src, []):
                self._link(src).put(msg)
        self.events.emit("peer_added", node=src, addr=f"{host}:{port}")
        return True

    def _tick_loop(self) -> None:
        last_retire = time.monotonic()
        while not self._stop.wait(self.heartbeat_s / 2):
            now = time.monotonic()
            with self._lock:
                targets: list[str] = []
                self._run(lambda: targets.extend(self.monitor.tick(now)))
                if self.core.fenced:
                    return
                if now - last_retire >= self.heartbeat_s:
                    last_retire = now
                    self._retire_idle(now, targets)
                if (self._join_how is not None and not self.core.joined
                        and now - self._join_asked >= self.lease_s):
                    self.request_join(self._join_how)
                if self._probe is not None and now >= self._probe[1]:
                    started, _, gen, why = self._probe
                    self._probe = None
                    probed = self.core.decided.nodes + self.core.round_joiners
                    silent = [n for n in probed if n != self.me
                              and n not in self.core.suspects and n not in self.core.left
                              and self.detector.last_heard.get(n, 0.0) < started]
                    for node in silent:
                        self._run(lambda n=node: self.core.suspect(
                            n, f"probe_unanswered (within probe_s={self.probe_s})"))
                    if not silent and self.core.decided.gen == gen:
                        self._run(lambda: self.core.retry(f"every peer answered the probe "
                                                          f"after: {why}"))

    def _retire_idle(self, now: float, targets: list[str]) -> None:
        """Close the links idle for IDLE_CLOSE_S that are not heartbeat targets."""
        for peer, link in list(self._links.items()):
            if peer not in targets and link.drained.is_set() and now - link.used > IDLE_CLOSE_S:
                del self._links[peer]
                link.put({"type": "unlink"})
                link.close(after_queue=True)
