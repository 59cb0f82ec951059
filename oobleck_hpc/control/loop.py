"""The control plane's sockets and timers: one event loop (selectors) in one thread per agent.

`EventLoop` owns the listening socket, the accepted connections, the outgoing links and the
ticker of one ControlPlane (plane.py), and calls into it with its lock held: `_known` and
`_on_message` for what arrives, `_link_failed` when a peer cannot be reached, `_connection_lost`
(in a short helper thread: it waits on the network) when an inbound connection ends without an
UNLINK, and `_tick` every heartbeat_s / 2. Owner threads queue messages (`Link.put`, with the lock
held) and wake the loop; nothing blocks the core.

Bounded sockets. An agent keeps at most `OUT_CAP` outgoing and `IN_CAP` accepted connections
open, however large the job:
- outgoing: a link opens its connection on its first message. A link that is not a heartbeat
  edge (`pin`) is closed once it has been idle `idle_close_s`; in a job larger than OUT_CAP
  (where an agent cannot keep a link to every peer it talks to) as soon as what it queued is
  written, and, when another link waits for a free slot, least recently used first. A
  coordinator's message to every member of a 1,000-node job goes out OUT_CAP connections at a
  time. Closing sends UNLINK first, so that the reader knows the peer is not gone.
- accepted: at most `IN_CAP` (inbound.py, which reads and checks what they send).

Authenticated (auth.py): a connection's first frame is the connector's HELLO, and every frame
both ways is sealed with that connection's keys when it is written (a message queued once is
sealed again on the connection that takes it after a failure).

Delivery. Messages to a peer go in order over one connection at a time. A failed connection is
retried on a fresh one (`SEND_ATTEMPTS` tries, `RETRY_PAUSE_S` apart; a refused connection ends
them at once: nobody listens on the peer's port, its agent is gone) before the peer is suspected,
so one flaky TCP connection does not exclude a healthy peer; the message being written is sent
again whole. Before a peer was first reached, connecting is retried until `startup_s` has
passed (agents start at different moments).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from oobleck_hpc.control.auth import AuthFailed, Sealer, hello
from oobleck_hpc.control.inbound import Acceptor, Inbound
from oobleck_hpc.control.messages import BadMessage, parse
from oobleck_hpc.control.wire import ConnectionClosed, decode_frames, encode_body, frame

SEND_ATTEMPTS = 3
"""Tries of one message (or one liveness check) on fresh connections before the peer is
suspected; a refused connection is not retried."""
RETRY_PAUSE_S = 0.05
"""Pause before each retry: a reconnect costs milliseconds, so the retries stay far below a
heartbeat."""
OUT_CAP = 24
"""Outgoing connections one agent holds open at most."""


class Link:
    """Outgoing messages to one peer: frames queued for the current (or next) connection."""

    def __init__(self, loop: EventLoop, peer: str, addr: tuple[str, int]):
        self.loop, self.peer, self.addr = loop, peer, addr
        self.pending: deque[bytes] = deque()
        """Bodies of the messages not yet wholly written; `offset` bytes of the first one's
        sealed frame (`wire`) are."""
        self.offset = 0
        self.wire: bytes | None = None
        self.later: deque[bytes] = deque()
        """Bodies queued while the connection closes (after its UNLINK): for the next one."""
        self.sock: socket.socket | None = None
        self.sealer: Sealer | None = None
        """The connection's keys (auth.py): what this side writes, what it reads."""
        self.opener: Sealer | None = None
        self.connecting = False
        self.closing = False
        self.connected_once = False
        self.failed = False
        self.attempts = 0
        self.deadline = 0.0
        self.used = time.monotonic()
        self.rbuf = bytearray()
        self.events = 0

    def put(self, msg: dict[str, Any]) -> None:
        """Queue `msg` (call with the control plane's lock held)."""
        if self.failed:
            return
        self.loop.cp.sent += 1
        self.used = time.monotonic()
        (self.later if self.closing else self.pending).append(self.loop.frame(msg))
        self.loop.kick(self)

    @property
    def drained(self) -> bool:
        return self.failed or not (self.pending or self.later)


class EventLoop:
    """One agent's sockets and timers in one thread (module docstring)."""

    def __init__(self, cp: Any, listener: socket.socket, idle_close_s: float):
        """`cp`: the owning ControlPlane (its lock, clock, timeouts and callbacks)."""
        self.cp = cp
        self.idle_close_s = idle_close_s
        self.sel = selectors.DefaultSelector()
        self.links: dict[str, Link] = {}
        self.pinned: frozenset[str] = frozenset()
        self.one_shot = False
        self._dirty: set[Link] = set()
        self._waiting: dict[Link, None] = {}  # ordered: links waiting for a free outgoing slot
        self._open: dict[Link, None] = {}  # links with a connection (at most OUT_CAP)
        self._framed: tuple[dict[str, Any] | None, bytes] = (None, b"")
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.acceptor = Acceptor(self, listener)
        self.peak = {"sockets": 0, "strangers": 0, "threads": 0}
        self.thread = threading.Thread(target=self._run, name=f"cp-{cp.me}-loop", daemon=True)

    # ------------------------------------------------------------------ owner's side

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the loop (it closes every socket) and wait for it, unless called from it."""
        self.wake()
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(timeout=5.0)

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (the loop is already woken) or closed (the loop ended)

    def kick(self, link: Link) -> None:
        self._dirty.add(link)
        if threading.current_thread() is not self.thread:
            self.wake()

    def link(self, peer: str, addr: tuple[str, int]) -> Link:
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = Link(self, peer, addr)
        return link

    def frame(self, msg: dict[str, Any]) -> bytes:
        """`msg`'s body, with this agent as its source; a message the core addressed to many
        peers (one dict) is encoded once (each connection seals it: `_write`)."""
        if self._framed[0] is not msg:
            self._framed = (msg, encode_body({**msg, "src": self.cp.me}))
        return self._framed[1]

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn))
        if threading.current_thread() is not self.thread:
            self.wake()  # its select() may be waiting longer than `delay`

    def pin(self, peers: list[str], now: float, one_shot: bool) -> None:
        """`peers` (this agent's observers: its heartbeat targets) keep their connections; the
        other links close once idle for idle_close_s (failed ones are forgotten then: a later
        message tries the peer afresh), or, if `one_shot` (a job larger than OUT_CAP, where
        this agent cannot keep a link to every peer it talks to), as soon as what they queued
        is written."""
        self.pinned = frozenset(peers)
        self.one_shot = one_shot
        self.acceptor.expire(now)
        for peer, link in list(self.links.items()):
            if peer in self.pinned or not link.drained or now - link.used <= self.idle_close_s:
                continue
            if link.sock is None:
                del self.links[peer]
            else:
                self._close_after_queue(link)

    def resources(self) -> dict[str, int]:
        """Sockets open now (listener, wake-up pair, outgoing, accepted, helpers' checks),
        strangers (accepted connections not authenticated yet) and threads (the loop,
        helpers)."""
        acc = self.acceptor
        return {"sockets": 3 + len(self._open) + len(acc.conns) + acc.helpers,
                "strangers": len(acc.strangers), "threads": 1 + acc.helpers}

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        stop = self.cp._stop
        try:
            self._loop(stop)
        except BaseException as e:  # a bug: this node can no longer take part in the job
            if not stop.is_set():
                self.cp._loop_died(e)
            raise
        finally:
            self._close_all()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            timeout = 0.0 if self._dirty else self.cp.heartbeat_s / 2
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0][0] - time.monotonic()))
            events = self.sel.select(timeout)
            with self.cp._lock:
                if stop.is_set():
                    break
                for key, mask in events:
                    self._dispatch(key, mask)
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    heapq.heappop(self._timers)[2]()
                self._service(now)
                res = self.resources()
                for k in self.peak:
                    self.peak[k] = max(self.peak[k], res[k])

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        data = key.data
        if data == "wake":
            try:
                self._wake_r.recv(4096)
            except OSError:
                pass
        elif data == "listen":
            self.acceptor.accept()
        elif isinstance(data, Inbound):
            if self.acceptor.conns.get(data.sock) is data:  # not closed earlier in this batch
                self.acceptor.read(data)
        elif isinstance(data, Link) and data.sock is key.fileobj:
            if data.connecting and mask & selectors.EVENT_WRITE:
                self._connected(data)
            elif mask & selectors.EVENT_READ:
                self._read_link(data)
            if data.sock is not None and not data.connecting and mask & selectors.EVENT_WRITE:
                self._write(data)

    def _service(self, now: float) -> None:
        """Connect or write what was queued, within OUT_CAP; time out slow connects."""
        for link in list(self._open):
            if link.connecting and now > link.deadline:
                self._attempt_failed(link, TimeoutError(f"connect to {link.addr} timed out"))
        dirty, self._dirty = self._dirty, set()
        for link in dirty:
            if link.failed or not link.pending:
                continue
            if link.sock is None:
                if link.peer in self.links and self.links[link.peer] is link:
                    self._waiting[link] = None
            elif not link.connecting:
                self._write(link)  # the kernel takes it at once unless its buffer is full
        while self._waiting and len(self._open) < OUT_CAP:
            link = next(iter(self._waiting))
            del self._waiting[link]
            if link.sock is None and link.pending and not link.failed:
                self._connect(link)
        if self._waiting:
            self._make_room()

    def _make_room(self) -> None:
        """Close idle links, least recently used first and pinned ones last (a heartbeat
        reopens those): one for each link waiting for a slot beyond those already closing (a
        slot frees once the UNLINK is written)."""
        want = len(self._waiting) - sum(1 for link in self._open if link.closing)
        if want > 0:
            idle = [link for link in self._open if not link.closing and not link.connecting
                    and not link.pending]
            idle.sort(key=lambda link: (link.peer in self.pinned, link.used))
            for link in idle[:want]:
                self._close_after_queue(link)

    # ------------------------------------------------------------------ outgoing

    def _connect(self, link: Link) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            err = sock.connect_ex(link.addr)
        except OSError as e:  # the host name does not resolve
            sock.close()
            self._attempt_failed(link, e)
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._attempt_failed(link, OSError(err, os.strerror(err)))
            return
        link.sock, link.connecting, link.offset, link.events = sock, True, 0, 0
        link.deadline = time.monotonic() + max(1.0, self.cp.lease_s)
        self._open[link] = None
        try:  # on loopback or a fast network the connection is often up at once: write now
            sock.getpeername()
        except OSError:
            self._watch(link)
            return
        self._connected(link)
        if link.sock is not None and not link.connecting:
            self._write(link)

    def _connected(self, link: Link) -> None:
        assert link.sock is not None
        err = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._attempt_failed(link, OSError(err, os.strerror(err)))
            return
        link.connecting = False
        link.connected_once = True
        cp = self.cp
        body, link.sealer, link.opener = hello(cp.secret, cp.me, link.peer, cp.addr.host,
                                               cp.addr.port)
        link.pending.appendleft(body)
        self._watch(link)

    def _write(self, link: Link) -> None:
        assert link.sock is not None
        assert link.sealer is not None
        try:
            while link.pending:
                if link.wire is None:
                    link.wire = frame(link.sealer.seal(link.pending[0]))
                n = link.sock.send(memoryview(link.wire)[link.offset:])
                link.offset += n
                if link.offset < len(link.wire):
                    break  # the kernel's buffer is full: wait until writable
                link.pending.popleft()
                link.offset, link.wire = 0, None
                link.attempts = 0
        except BlockingIOError:
            pass
        except OSError as e:
            self._attempt_failed(link, e)
            return
        if not link.pending and not link.closing and self.one_shot and link.peer not in self.pinned:
            self._close_after_queue(link)
            return
        if not link.pending and link.closing:
            self._disconnect(link)
            if link.later:
                link.pending, link.later = link.later, deque()
                self._dirty.add(link)
            return
        self._watch(link)

    def _read_link(self, link: Link) -> None:
        """The receiver wrote on our link: a DROP request, or the end of the connection."""
        assert link.sock is not None
        try:
            data = link.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the peer closed: retry what is queued, else reconnect when needed
            if link.pending:
                self._attempt_failed(link, ConnectionResetError("connection closed by peer"))
            else:
                self._disconnect(link)
            return
        link.rbuf += data
        assert link.opener is not None
        try:
            msgs = [parse(link.opener.open(p)) for p in decode_frames(link.rbuf)]
        except (ConnectionClosed, BadMessage, AuthFailed) as e:
            # (not its peer's agent: another process on its port, or a corrupt stream)
            self.cp._frame_rejected(link.peer, f"{link.addr[0]}:{link.addr[1]}", str(e))
            self._attempt_failed(link, ConnectionResetError(f"bad frame from {link.addr}"))
            return
        if any(m["type"] == "drop" for m in msgs) and not link.closing:
            self._close_after_queue(link)

    def _close_after_queue(self, link: Link) -> None:
        """Send UNLINK after what is queued, then close; later messages wait for a new
        connection."""
        link.closing = True
        link.pending.append(encode_body({"type": "unlink", "src": self.cp.me}))
        if link.sock is not None and not link.connecting:
            self._write(link)
        else:
            self._dirty.add(link)

    def _watch(self, link: Link) -> None:
        assert link.sock is not None
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.connecting or link.pending
                                         else 0)
        if events != link.events:
            if link.events:
                self.sel.modify(link.sock, events, link)
            else:
                self.sel.register(link.sock, events, link)
            link.events = events

    def _disconnect(self, link: Link) -> None:
        if link.sock is not None:
            if link.events:
                self.sel.unregister(link.sock)
            link.sock.close()
            del self._open[link]
        link.sock, link.connecting, link.closing, link.offset, link.events = None, False, False, 0, 0
        link.wire = link.sealer = link.opener = None
        link.rbuf.clear()

    def _attempt_failed(self, link: Link, error: OSError) -> None:
        """A connection to `link`'s peer failed: retry (module docstring) or suspect the peer."""
        closing = link.closing
        self._disconnect(link)
        if closing and link.pending:
            link.pending.pop()  # the UNLINK (always last while closing) was for this connection
        link.pending.extend(link.later)
        link.later.clear()
        if not link.pending:
            return
        now = time.monotonic()
        if not link.connected_once and now < self.cp._t0 + self.cp.startup_s:
            self.after(RETRY_PAUSE_S, lambda: self._dirty.add(link))
            return
        link.attempts += 1
        if isinstance(error, ConnectionRefusedError) or link.attempts >= SEND_ATTEMPTS:
            link.failed = True
            link.pending.clear()
            self._waiting.pop(link, None)
            self.cp._link_failed(link.peer, f"send_failed ({error})")
        else:
            self.after(RETRY_PAUSE_S, lambda: self._dirty.add(link))

    def _close_all(self) -> None:
        for link in self._open:
            if link.sock is not None:
                link.sock.close()
                link.sock = None
        self._open.clear()
        self.acceptor.close_all()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self.sel.close()
