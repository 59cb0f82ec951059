"""The accepted side of an agent's event loop (loop.py; links.py is the connecting side): its
listening socket and the connections other agents opened to it.

Every frame is authenticated (auth.py) and validated (messages.py) before anything acts on it;
a connection that sends what cannot be acted on -- a first frame that is not a verified, fresh
HELLO from another node to this one, a frame whose MAC fails, a frame that is not a known
message, a handler that raises on it -- is closed alone and recorded (`frame_rejected`); it is
not a lost peer (a member's sender reconnects), and the loop goes on.

Strangers. Until its HELLO verifies, an accepted connection is a stranger: it may send
PRE_AUTH_BYTES and is closed after AUTH_DEADLINE_S; at most `stranger_cap` (twice the roster,
at least STRANGERS) are held, a new one closing the oldest. Strangers do not count against
IN_CAP: a flood of them never makes members close theirs.

Bounded: at `IN_CAP` authenticated connections the loop stops accepting (new connections wait in
the kernel's listen backlog, which holds no descriptor of this process) and asks the senders of
the least recently heard connections (`DROP_ASKED` at a time) to close theirs (DROP on that
connection). A sender finishes what it queued, sends UNLINK and closes; its later messages open a
new connection. The reader closes only after UNLINK (or, for a sender that has not answered
within lease_s, once its lease has judged it).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from oobleck_hpc.control.auth import (AUTH_DEADLINE_S, MAC_BYTES, PRE_AUTH_BYTES, AuthFailed,
                                      Replays, Sealer, keys)
from oobleck_hpc.control.messages import BadMessage, parse
from oobleck_hpc.control.wire import ConnectionClosed, decode_frames, encode_body, frame

if TYPE_CHECKING:
    from oobleck_hpc.control.loop import EventLoop

IN_CAP = 32
"""Authenticated accepted connections one agent holds open at most."""
STRANGERS = 64
"""Unauthenticated accepted connections held at least (module docstring)."""
DROP_ASKED = 32
"""Accepted connections whose senders are asked to close at once when IN_CAP is reached."""

_DROP = encode_body({"type": "drop"})


class Inbound:
    """An accepted connection: its sender and keys (after HELLO) and the bytes read so far."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.src: str | None = None
        self.opener: Sealer | None = None
        self.sealer: Sealer | None = None
        self.rbuf = bytearray()
        self.accepted = self.heard = time.monotonic()
        self.drop_asked = 0.0
        """When its sender was asked to close it (0: not asked)."""


class Acceptor:
    """The listening socket and accepted connections of one EventLoop (module docstring); runs
    on the loop's thread, with the control plane's lock held."""

    def __init__(self, loop: EventLoop, listener: socket.socket):
        self.loop, self.cp, self.listener = loop, loop.cp, listener
        self.conns: dict[socket.socket, Inbound] = {}
        self.strangers: dict[socket.socket, Inbound] = {}
        """The connections not authenticated yet, oldest first."""
        self.replays = Replays()
        self.listening = False
        self.helpers = 0  # the thread checking lost connections (`checks`), while it runs
        self.checks: deque[str] = deque()
        listener.setblocking(False)
        self.listen(True)

    def listen(self, on: bool) -> None:
        if on and not self.listening:
            self.loop.sel.register(self.listener, selectors.EVENT_READ, "listen")
        elif not on and self.listening:
            self.loop.sel.unregister(self.listener)
        self.listening = on

    @property
    def stranger_cap(self) -> int:
        return max(STRANGERS, 2 * len(self.cp.roster.nodes))

    def members(self) -> int:
        return len(self.conns) - len(self.strangers)

    def accept(self) -> None:
        while self.members() < IN_CAP:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # (BlockingIOError: none waiting)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self.conns[sock] = self.strangers[sock] = Inbound(sock)
            self.loop.sel.register(sock, selectors.EVENT_READ, conn)
            if len(self.strangers) > self.stranger_cap:
                self.close(next(iter(self.strangers.values())), lost=False)
            self.read(conn)  # what was sent with the connection is often there
        self._full()

    def _full(self) -> None:
        """IN_CAP members: stop accepting until a connection closes, and ask the senders of the
        least recently heard ones to close theirs (DROP_ASKED at a time)."""
        self.listen(False)
        conns = self.conns.values()
        want = DROP_ASKED - sum(1 for c in conns if c.drop_asked)
        if want > 0:
            idle = [c for c in conns if c.src is not None and not c.drop_asked]
            for conn in sorted(idle, key=lambda c: c.heard)[:want]:
                conn.drop_asked = time.monotonic()
                assert conn.sealer is not None
                try:
                    conn.sock.send(frame(conn.sealer.seal(_DROP)))
                except OSError:
                    pass

    def expire(self, now: float) -> None:
        """Close the connections whose senders were asked to close over lease_s ago (hung or
        gone: their lease judges them), and strangers past AUTH_DEADLINE_S."""
        for conn in list(self.conns.values()):
            if conn.drop_asked and now - conn.drop_asked > self.cp.lease_s:
                self.close(conn, lost=False)
        for conn in list(self.strangers.values()):
            if now - conn.accepted <= AUTH_DEADLINE_S:
                break  # (oldest first)
            self.close(conn, lost=False)

    def read(self, conn: Inbound) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(conn, lost=True)
            return
        conn.rbuf += data
        conn.heard = time.monotonic()
        try:
            if conn.src is None:  # its first frame: a HELLO of at most PRE_AUTH_BYTES
                first = decode_frames(conn.rbuf, PRE_AUTH_BYTES, most=1)
                if not first:
                    return
                hello = self._hello(conn, first[0])
                self.cp._on_message(hello["src"], hello)
            assert conn.opener is not None
            for payload in decode_frames(conn.rbuf):
                msg = parse(conn.opener.open(payload))
                if msg["type"] == "unlink":
                    self.close(conn, lost=False)  # the sender closed an idle link
                    return
                self.cp._on_message(conn.src, msg)
        except (ConnectionClosed, BadMessage, AuthFailed) as e:
            self.reject(conn, str(e))
        except Exception as e:  # a handler's bug must not end the loop: this connection ends
            self.reject(conn, f"handler failed: {type(e).__name__}: {e}")

    def _hello(self, conn: Inbound, payload: bytes) -> dict:
        """A stranger's first frame: a HELLO sealed with the run's secret, from another node,
        to this one, fresh and not seen before (auth.py). It becomes that node's connection."""
        msg = parse(payload[MAC_BYTES:])
        src = msg.get("src")
        if msg["type"] != "hello" or not isinstance(src, str) or src == self.cp.me \
                or msg["to"] != self.cp.me:
            raise BadMessage(f"a connection must start with HELLO from another node to "
                             f"{self.cp.me}, not {msg['type']} from {str(src)[:40]!r}")
        out, back = keys(self.cp.secret, msg["nonce"], src, self.cp.me)
        conn.opener, conn.sealer = Sealer(out), Sealer(back)
        conn.opener.open(payload)
        self.replays.check(msg)
        if not self.cp._known(src, msg):
            raise BadMessage(f"HELLO from {src!r}: not a node of the job")
        conn.src = src
        del self.strangers[conn.sock]
        if self.members() >= IN_CAP:
            self._full()
        return msg

    def reject(self, conn: Inbound, reason: str) -> None:
        """Close a connection that sent what cannot be acted on, and record it."""
        try:
            host, port = conn.sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        self.close(conn, lost=False)
        self.cp._frame_rejected(conn.src, peer, reason)

    def close(self, conn: Inbound, lost: bool) -> None:
        """Close an accepted connection; one that ended without UNLINK is checked (a helper
        thread: ControlPlane._connection_lost)."""
        self.loop.sel.unregister(conn.sock)
        conn.sock.close()
        del self.conns[conn.sock]
        self.strangers.pop(conn.sock, None)
        self.listen(True)
        if lost and conn.src is not None and not self.cp._stop.is_set():
            self.checks.append(conn.src)
            if not self.helpers:  # one helper checks them in turn (it waits on the network)
                self.helpers = 1
                threading.Thread(target=self._check, daemon=True,
                                 name=f"cp-{self.cp.me}-check").start()

    def _check(self) -> None:
        while True:
            with self.cp._lock:
                if not self.checks or self.cp._stop.is_set():
                    self.helpers = 0
                    return
                peer = self.checks.popleft()
            self.cp._connection_lost(peer)

    def close_all(self) -> None:
        for conn in self.conns.values():
            conn.sock.close()
        self.conns.clear()
        self.strangers.clear()
        try:
            self.listener.close()
        except OSError:
            pass
