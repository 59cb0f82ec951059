"""Outgoing links of the control plane (control.py): one queue and one sender thread per peer
this agent talks to, with the retry rule that keeps one flaky TCP connection from excluding a
healthy peer, and `reach`, the check that a peer still listens."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

from oobleck_hpc.elastic.wire import send_msg

SEND_ATTEMPTS = 3
"""Tries of one message (or one liveness check) on fresh connections before the peer is
suspected; a refused connection is not retried."""
RETRY_PAUSE_S = 0.05
"""Pause before each retry: a reconnect costs milliseconds, so the retries stay far below a
heartbeat."""
CONFIRM_S = 0.1
"""How long a connection opened to check a peer must stay open (and silent) to prove the peer
alive."""


class Link:
    """Outgoing messages to one peer: a queue drained by a sender thread."""

    def __init__(self, cp: Any, peer: str, addr: tuple[str, int]):
        """`cp`: the owning ControlPlane (its clock, timeouts, stop event and failure callback)."""
        self.cp, self.peer, self.addr = cp, peer, addr
        self.q: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.connected_once = False
        self.failed = False
        self.drained = threading.Event()
        self.drained.set()
        self.used = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name=f"cp-{cp.me}-to-{peer}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, msg: dict[str, Any]) -> None:
        if not self.failed:
            self.cp.sent += 1
            self.used = time.monotonic()
            self.drained.clear()
            self.q.put(msg)

    def close(self, after_queue: bool = False) -> None:
        """Stop the sender; `after_queue`: once what is queued is sent (else at once)."""
        self.q.put(None)
        if not after_queue and self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass

    def _connect(self) -> None:
        """Open the connection and say HELLO. Until the first success, retries for startup_s
        (agents start at different moments); after it, one try. Raises OSError."""
        deadline = self.cp._t0 + self.cp.startup_s
        while True:
            try:
                sock = socket.create_connection(self.addr, timeout=max(1.0, self.cp.lease_s))
                break
            except OSError:
                if self.connected_once or time.monotonic() > deadline or self.cp._stop.is_set():
                    raise
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.connected_once = True
        send_msg(sock, {"type": "hello", "src": self.cp.me, "host": self.cp.addr.host,
                        "port": self.cp.addr.port})

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    def _deliver(self, msg: dict[str, Any]) -> OSError | None:
        """Send `msg`, on a fresh connection if the current one fails (SEND_ATTEMPTS tries; a
        refused connection ends them). Returns the last error, None once sent."""
        error: OSError | None = None
        for attempt in range(SEND_ATTEMPTS):
            if attempt and self.cp._stop.wait(RETRY_PAUSE_S):
                break
            try:
                if self.sock is None:
                    self._connect()
                assert self.sock is not None
                send_msg(self.sock, {**msg, "src": self.cp.me})
                return None
            except OSError as e:
                error = e
                self._drop()
                if isinstance(e, ConnectionRefusedError):
                    break
        return error

    def _loop(self) -> None:
        # Connect as soon as the link exists (control.py opens it for its first message).
        try:
            self._connect()
        except OSError:
            self._drop()
        while True:
            if self.q.empty():
                self.drained.set()
            msg = self.q.get()
            if msg is None or self.cp._stop.is_set():
                self._drop()
                return
            if self.failed:
                continue
            error = self._deliver(msg)
            if error is not None:
                self.failed = True
                if not self.cp._stop.is_set():
                    self.cp._link_failed(self.peer, f"send_failed ({error})")


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
