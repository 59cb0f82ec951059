"""The connecting side of an agent's event loop (loop.py): the outgoing links to its peers.

Bounded: an agent keeps at most `OUT_CAP` outgoing connections open, however large the job. A
link opens its connection on its first message. A link that is not a heartbeat edge (`pin`) is
closed once it has been idle `idle_close_s`; in a job larger than OUT_CAP (where an agent cannot
keep a link to every peer it talks to) as soon as what it queued is written, and, when another
link waits for a free slot, least recently used first. A coordinator's message to every member
of a 1,000-node job goes out OUT_CAP connections at a time. Closing sends UNLINK first, so that
the reader knows the peer is not gone.

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
import os
import selectors
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from oobleck_hpc.control.auth import AuthFailed, Sealer, hello
from oobleck_hpc.control.messages import BadMessage, parse
from oobleck_hpc.control.wire import ConnectionClosed, decode_frames, encode_body, frame

if TYPE_CHECKING:
    from oobleck_hpc.control.loop import EventLoop

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

    def __init__(self, connector: Connector, peer: str, addr: tuple[str, int]):
        self.connector, self.peer, self.addr = connector, peer, addr
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
        self.connector.cp.sent += 1
        self.used = time.monotonic()
        (self.later if self.closing else self.pending).append(self.connector.frame(msg))
        self.connector.kick(self)

    @property
    def drained(self) -> bool:
        return self.failed or not (self.pending or self.later)


class Connector:
    """The outgoing links of one EventLoop (module docstring); runs on the loop's thread, with
    the control plane's lock held, except `link`, `frame` and `kick` (the owner's threads call
    them through `Link.put`, with the lock held)."""

    def __init__(self, loop: EventLoop, idle_close_s: float):
        self.loop, self.cp, self.idle_close_s = loop, loop.cp, idle_close_s
        self.links: dict[str, Link] = {}
        self.pinned: frozenset[str] = frozenset()
        self.one_shot = False
        self.dirty: set[Link] = set()
        """Links with something new to connect or write (`service`)."""
        self._waiting: dict[Link, None] = {}  # ordered: links waiting for a free outgoing slot
        self.open: dict[Link, None] = {}  # links with a connection (at most OUT_CAP)
        self._framed: tuple[dict[str, Any] | None, bytes] = (None, b"")

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

    def kick(self, link: Link) -> None:
        self.dirty.add(link)
        if threading.current_thread() is not self.loop.thread:
            self.loop.wake()

    def pin(self, peers: list[str], now: float, one_shot: bool) -> None:
        """EventLoop.pin, for the outgoing links."""
        self.pinned = frozenset(peers)
        self.one_shot = one_shot
        for peer, link in list(self.links.items()):
            if peer in self.pinned or not link.drained or now - link.used <= self.idle_close_s:
                continue
            if link.sock is None:
                del self.links[peer]
            else:
                self._close_after_queue(link)

    def ready(self, link: Link, mask: int) -> None:
        """`link`'s socket is ready (`mask`: selectors' events)."""
        if link.connecting and mask & selectors.EVENT_WRITE:
            self._connected(link)
        elif mask & selectors.EVENT_READ:
            self._read(link)
        if link.sock is not None and not link.connecting and mask & selectors.EVENT_WRITE:
            self._write(link)

    def service(self, now: float) -> None:
        """Connect or write what was queued, within OUT_CAP; time out slow connects."""
        for link in list(self.open):
            if link.connecting and now > link.deadline:
                self._attempt_failed(link, TimeoutError(f"connect to {link.addr} timed out"))
        dirty, self.dirty = self.dirty, set()
        for link in dirty:
            if link.failed or not link.pending:
                continue
            if link.sock is None:
                if link.peer in self.links and self.links[link.peer] is link:
                    self._waiting[link] = None
            elif not link.connecting:
                self._write(link)  # the kernel takes it at once unless its buffer is full
        while self._waiting and len(self.open) < OUT_CAP:
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
        want = len(self._waiting) - sum(1 for link in self.open if link.closing)
        if want > 0:
            idle = [link for link in self.open if not link.closing and not link.connecting
                    and not link.pending]
            idle.sort(key=lambda link: (link.peer in self.pinned, link.used))
            for link in idle[:want]:
                self._close_after_queue(link)

    # ------------------------------------------------------------------ one link

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
        self.open[link] = None
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
                self.dirty.add(link)
            return
        self._watch(link)

    def _read(self, link: Link) -> None:
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
            self.dirty.add(link)

    def _watch(self, link: Link) -> None:
        assert link.sock is not None
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.connecting or link.pending
                                         else 0)
        if events != link.events:
            if link.events:
                self.loop.sel.modify(link.sock, events, link)
            else:
                self.loop.sel.register(link.sock, events, link)
            link.events = events

    def _disconnect(self, link: Link) -> None:
        if link.sock is not None:
            if link.events:
                self.loop.sel.unregister(link.sock)
            link.sock.close()
            del self.open[link]
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
            self.loop.after(RETRY_PAUSE_S, lambda: self.dirty.add(link))
            return
        link.attempts += 1
        if isinstance(error, ConnectionRefusedError) or link.attempts >= SEND_ATTEMPTS:
            link.failed = True
            link.pending.clear()
            self._waiting.pop(link, None)
            self.cp._link_failed(link.peer, f"send_failed ({error})")
        else:
            self.loop.after(RETRY_PAUSE_S, lambda: self.dirty.add(link))

    def close_all(self) -> None:
        for link in self.open:
            if link.sock is not None:
                link.sock.close()
                link.sock = None
        self.open.clear()


CONFIRM_S = 0.1
"""How long a connection opened to check a peer must stay open (and silent) to prove the peer
alive (`reach`)."""


def reach(host: str, port: int, timeout: float, stop: threading.Event) -> OSError | None:
    """Whether an agent still listens on host:port: None if a connection opens and stays open
    for CONFIRM_S (then it is closed; the peer reads no HELLO and drops it), else the last error
    of SEND_ATTEMPTS tries (a refusal or a reset at once: nobody listens)."""
    error: OSError | None = None
    for attempt in range(SEND_ATTEMPTS):
        if attempt and stop.wait(RETRY_PAUSE_S):
            break
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                # A dying agent's listener may still accept for a moment; the kernel resets
                # what it accepted once the listener closes. A live agent waits for a HELLO.
                sock.settimeout(CONFIRM_S)
                try:
                    if sock.recv(1) == b"":
                        return ConnectionResetError(f"{host}:{port} closed the connection")
                except TimeoutError:
                    return None
        except ConnectionRefusedError as e:
            return e
        except OSError as e:
            error = e
    return error
