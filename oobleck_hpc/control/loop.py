"""The control plane's sockets and timers: one event loop (selectors) in one thread per agent.

`EventLoop` owns the selector, the timers and the ticker of one ControlPlane (plane.py), with two
sides: the accepted connections (`Acceptor`, inbound.py) and the outgoing links (`Connector`,
links.py). It calls into the plane with its lock held: `_known` and `_on_message` for what
arrives, `_link_failed` when a peer cannot be reached, `_connection_lost` (in a short helper
thread: it waits on the network) when an inbound connection ends without an UNLINK, and `_tick`
every heartbeat_s / 2. Owner threads queue messages (`Link.put`, with the lock held) and wake the
loop; nothing blocks the core.

Bounded sockets: an agent keeps at most `OUT_CAP` outgoing (links.py) and `IN_CAP` accepted
(inbound.py) connections open, however large the job.
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import Any, Callable

from oobleck_hpc.control.inbound import Acceptor, Inbound
from oobleck_hpc.control.links import Connector, Link

IDLE_CLOSE_S = 10.0
"""An outgoing link idle for this long to a node that is not an observer of this agent is
closed (a round's messages to every member opened it)."""


class EventLoop:
    """One agent's sockets and timers in one thread (module docstring)."""

    def __init__(self, cp: Any, listener: socket.socket, idle_close_s: float = IDLE_CLOSE_S):
        """`cp`: the owning ControlPlane (its lock, clock, timeouts and callbacks)."""
        self.cp = cp
        self.sel = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.acceptor = Acceptor(self, listener)
        self.connector = Connector(self, idle_close_s)
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
        self.acceptor.expire(now)
        self.connector.pin(peers, now, one_shot)

    def resources(self) -> dict[str, int]:
        """Sockets open now (listener, wake-up pair, outgoing, accepted, helpers' checks),
        strangers (accepted connections not authenticated yet) and threads (the loop,
        helpers)."""
        acc = self.acceptor
        return {"sockets": 3 + len(self.connector.open) + len(acc.conns) + acc.helpers,
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
            timeout = 0.0 if self.connector.dirty else self.cp.heartbeat_s / 2
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
                self.connector.service(now)
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
            self.connector.ready(data, mask)

    def _close_all(self) -> None:
        self.connector.close_all()
        self.acceptor.close_all()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self.sel.close()
