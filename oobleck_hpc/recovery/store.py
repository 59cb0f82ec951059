"""The rendezvous store: torch's `Store` interface, served to the run's own ranks only (issue 28).

torch's TCPStore authenticates nobody: whoever reaches its port may get, set, add, delete and
list (`list_keys`) every key, and so read the ranks' gloo addresses or NCCL ids, or break a
rendezvous. This store speaks the control plane's authenticated connections instead (auth.py):

- the client's first frame is a HELLO sealed with the run's secret, addressed to the store by
  its name (`rendezvous.store_prefix`: derived from the secret and the generation, so a HELLO
  for one generation's store is refused by another's), fresh and never seen before (`Replays`);
  the server answers it (so a client knows it was taken before it goes on); until it
  verifies, a connection may send auth.PRE_AUTH_BYTES and is closed after
  auth.AUTH_DEADLINE_S; at most MAX_STRANGERS such connections are held (a new one closes the
  oldest), so a flood of them delays no rank for long;
- every frame after it, both ways, carries its HMAC-SHA256 over a per-direction sequence number
  and the body (auth.Sealer); one that does not verify, or a request that does not decode,
  closes that connection and nothing else.

The server (`StoreServer`) is one thread with a selector in the process that hosts the store
(the generation's first rank); it lives as long as that process's `AuthStore` object (torch's
TCPStore server the same). A request is a JSON object {"op", "keys", "values" (base64), "n",
"timeout"}; the reply {"ok": ...} or {"error": ...}. Blocking requests (get, wait) wait on the
server, never on a thread per client, and fail at their timeout. The operations are those
gloo, NCCL and the driver use, with TCPStore's meaning: set, get, add, check, wait,
compare_set, delete_key, num_keys. There is no list_keys.

A client (`AuthStore`) keeps one TCP connection to host:port, one request at a time: an error of
the connection is a DistNetworkError, a timeout or a refused request a DistStoreError (both
RuntimeErrors, like torch's). `rendezvous.release_connections` shuts the connection down the
same way it did TCPStore's. torch calls a Python store through its own reference to the C++
object, which does not keep the Python object alive: the caller must hold the AuthStore for as
long as process groups built on it may use it (the driver's `store`).

torch APIs: torch.distributed.Store (subclassed, public), DistStoreError, DistNetworkError.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import selectors
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from oobleck_hpc.control.auth import (AUTH_DEADLINE_S, MAC_BYTES, PRE_AUTH_BYTES, AuthFailed,
                                      Replays, Sealer, hello, keys)
from oobleck_hpc.control.messages import BadMessage, parse
from oobleck_hpc.control.wire import ConnectionClosed, decode_frames, frame, recv_frame
from oobleck_hpc.polling import pause

MAX_REQUEST = 1 << 20
"""Bytes of one request (a rendezvous value is an address or an id: a few hundred bytes)."""
MAX_STRANGERS = 64
"""Connections held before their HELLO verifies; a new one closes the oldest."""
MAX_TIMEOUT_S = 3600.0

# op: (keys it takes: 1 or "many", values it takes, blocks until its keys exist)
OPS: dict[str, tuple[int | str, int | str, bool]] = {
    "set": (1, 1, False), "get": (1, 0, True), "add": (1, 0, False), "check": ("many", 0, False),
    "wait": ("many", 0, True), "compare_set": (1, 2, False), "delete_key": (1, 0, False),
    "num_keys": (0, 0, False)}


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


@dataclass(frozen=True)
class Request:
    op: str
    keys: list[str]
    values: list[bytes]
    n: int  # add's increment
    timeout: float  # how long a blocking op waits for its keys, in seconds

    @property
    def blocks(self) -> bool:
        return OPS[self.op][2]


def decode_request(body: bytes) -> Request:
    """A request from its frame's body, validated (OPS); raises BadMessage."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BadMessage(f"request not JSON ({type(e).__name__})") from None
    if type(req) is not dict or req.get("op") not in OPS:
        raise BadMessage(f"not a store request: {str(req)[:60]!r}")
    n_keys, n_values, _ = OPS[req["op"]]
    ks, vs = req.get("keys", []), req.get("values", [])
    if (type(ks) is not list or not all(type(k) is str for k in ks)
            or (len(ks) != n_keys if n_keys != "many" else not ks)):
        raise BadMessage(f"{req['op']}: wrong keys")
    if type(vs) is not list or len(vs) != n_values or not all(type(v) is str for v in vs):
        raise BadMessage(f"{req['op']}: wrong values")
    try:
        values = [base64.b64decode(v, validate=True) for v in vs]
    except binascii.Error:
        raise BadMessage(f"{req['op']}: a value is not base64") from None
    n, timeout = req.get("n", 0), req.get("timeout", 0.0)
    if type(n) is not int or type(timeout) not in (int, float) or not 0 <= timeout <= MAX_TIMEOUT_S:
        raise BadMessage(f"{req['op']}: wrong n or timeout")
    return Request(req["op"], ks, values, n, float(timeout))


# ---------------------------------------------------------------------- the server


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    since: float
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    opener: Sealer | None = None  # None until its HELLO verified: a stranger
    sealer: Sealer | None = None
    waiting: tuple[Request, float] | None = None  # a blocking request, its deadline


class StoreServer:
    """The store's keys and its listener's connections, served by one thread (module
    docstring). `sock`: a listening socket, now the server's."""

    def __init__(self, sock: socket.socket, secret: bytes, name: str):
        self.sock, self.secret, self.name = sock, secret, name
        self.data: dict[str, bytes] = {}
        self.conns: dict[socket.socket, _Conn] = {}
        self.strangers: dict[socket.socket, _Conn] = {}  # in order of arrival
        self.replays = Replays()
        self.rejected = 0
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)
        self.sel.register(self._wake_r, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"store-{name[:16]}")
        self.thread.start()

    def close(self) -> None:
        """Stop serving: every connection and the listener closed (idempotent)."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(5.0)

    def _loop(self) -> None:
        try:
            while not self._stop:
                for key, events in self.sel.select(timeout=0.25):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        self._ready(self.conns[key.fileobj], events)
                self._expire(time.monotonic())
        finally:
            if self.rejected:
                print(f"[store {self.name}] refused {self.rejected} connections (no or a wrong "
                      f"HELLO, or a request that did not verify)", file=sys.stderr, flush=True)
            for sock in list(self.conns):
                sock.close()
            for s in (self.sock, self._wake_r, self._wake_w):
                s.close()
            self.sel.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, time.monotonic())
        self.conns[sock] = self.strangers[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ)
        if len(self.strangers) > MAX_STRANGERS:
            self._drop(next(iter(self.strangers.values())), "too many connections without HELLO")

    def _drop(self, conn: _Conn, reason: str | None = None) -> None:
        """Close conn; `reason`: it was refused (counted in `rejected`)."""
        if reason is not None:
            self.rejected += 1
        self.sel.unregister(conn.sock)
        conn.sock.close()
        del self.conns[conn.sock]
        self.strangers.pop(conn.sock, None)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.strangers.values() if now - c.since > AUTH_DEADLINE_S]:
            self._drop(conn, "no verified HELLO in time")
        for conn in [c for c in self.conns.values() if c.waiting and c.waiting[1] < now]:
            req = conn.waiting[0]
            conn.waiting = None
            self._reply(conn, {"error": f"{req.op} {req.keys[:3]}: timed out after "
                                        f"{req.timeout:.1f} s"})
            self._serve(conn)

    def _ready(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if events & selectors.EVENT_READ and conn.sock in self.conns:
            try:
                data = conn.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                data = b""
                self._drop(conn, str(e))
            if not data:
                if conn.sock in self.conns:
                    self._drop(conn)  # closed by the client
                return
            conn.rbuf += data
            self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        """Answer conn's whole frames; what cannot be answered closes conn, and only conn."""
        try:
            if conn.opener is None and len(conn.rbuf) > PRE_AUTH_BYTES:
                raise BadMessage(f"more than {PRE_AUTH_BYTES} bytes before a HELLO")
            self._answer(conn)
        except (ConnectionClosed, BadMessage, AuthFailed) as e:
            self._drop(conn, str(e))
        except Exception as e:  # a bug ends this connection, never the server
            self._drop(conn, f"handler failed: {type(e).__name__}: {e}")

    def _answer(self, conn: _Conn) -> None:
        """Answer conn's whole frames in order, up to its first blocking request that must
        wait (the client sends one request at a time)."""
        while conn.waiting is None and conn.sock in self.conns:
            bodies = decode_frames(conn.rbuf, MAX_REQUEST, most=1)
            if not bodies:
                return
            if conn.opener is None:
                self._hello(conn, bodies[0])
                continue
            assert conn.opener is not None
            req = decode_request(conn.opener.open(bodies[0]))
            if req.blocks and not all(k in self.data for k in req.keys):
                conn.waiting = (req, time.monotonic() + req.timeout)
                return
            self._reply(conn, self._do(req))

    def _hello(self, conn: _Conn, payload: bytes) -> None:
        msg = parse(payload[MAC_BYTES:])
        if msg["type"] != "hello" or msg["to"] != self.name:
            raise BadMessage(f"a connection must start with a HELLO to this store, not "
                             f"{msg['type']} to {str(msg.get('to'))[:40]!r}")
        out, back = keys(self.secret, msg["nonce"], msg["src"], self.name)
        conn.opener, conn.sealer = Sealer(out), Sealer(back)
        conn.opener.open(payload)
        self.replays.check(msg)
        del self.strangers[conn.sock]
        self._reply(conn, {"ok": "hello"})

    def _do(self, req: Request) -> dict[str, Any]:
        """One request's reply; a change wakes the requests waiting for keys."""
        op, ks, vs, data = req.op, req.keys, req.values, self.data
        if op == "get":
            return {"ok": _b64(data[ks[0]])}
        if op == "wait":
            return {"ok": None}
        if op == "check":
            return {"ok": all(k in data for k in ks)}
        if op == "num_keys":
            return {"ok": len(data)}
        if op == "delete_key":
            return {"ok": data.pop(ks[0], None) is not None}
        if op == "add":
            try:
                value = int(data.get(ks[0], b"0")) + req.n
            except ValueError:
                return {"error": f"add {ks[0]!r}: its value is not an integer"}
            data[ks[0]] = str(value).encode()
            reply: dict[str, Any] = {"ok": value}
        elif op == "set":
            data[ks[0]] = vs[0]
            reply = {"ok": None}
        else:  # compare_set, as TCPStore: set if equal to expected (missing counts as b"")
            current = data.get(ks[0])
            if current == vs[0] or (current is None and vs[0] == b""):
                data[ks[0]] = current = vs[1]
            reply = {"ok": _b64(vs[0] if current is None else current)}
        self._wake_waiters()
        return reply

    def _wake_waiters(self) -> None:
        for conn in [c for c in self.conns.values() if c.waiting]:
            req = conn.waiting[0]
            if all(k in self.data for k in req.keys):
                conn.waiting = None
                self._reply(conn, self._do(req))
                self._serve(conn)

    def _reply(self, conn: _Conn, reply: dict[str, Any]) -> None:
        assert conn.sealer is not None
        conn.wbuf += frame(conn.sealer.seal(json.dumps(reply).encode()))
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.sock not in self.conns:
            return
        try:
            sent = conn.sock.send(conn.wbuf)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._drop(conn, str(e))
            return
        del conn.wbuf[:sent]
        self.sel.modify(conn.sock, selectors.EVENT_READ | (
            selectors.EVENT_WRITE if conn.wbuf else 0))


# ---------------------------------------------------------------------- the client


class AuthStore(dist.Store):
    """A client of the store `name` at host:port (module docstring); keys live under `name`
    + "/". `server`: the StoreServer this process hosts, closed with this object."""

    def __init__(self, host: str, port: int, secret: bytes, name: str,
                 timeout: datetime.timedelta, server: StoreServer | None = None):
        super().__init__()
        self.set_timeout(timeout)
        self.host, self.port, self.name, self.server = host, port, name, server
        self._lock = threading.Lock()
        since = time.monotonic()
        deadline = since + timeout.total_seconds()
        while True:
            try:
                self._sock = self._connect(secret, deadline)
                break
            except (OSError, ConnectionClosed, AuthFailed, ValueError) as e:
                if time.monotonic() > deadline:
                    raise dist.DistNetworkError(
                        f"the store {host}:{port} cannot be reached, or refused this process, "
                        f"within {timeout.total_seconds():.0f} s: {type(e).__name__}: {e}"
                    ) from e
                pause(since)  # (the host is starting: poll its port cheaply)
        weakref.finalize(self, _close, self._sock, server)

    def _connect(self, secret: bytes, deadline: float) -> socket.socket:
        """A connection to the store whose HELLO the server took (it answers "hello")."""
        sock = socket.create_connection((self.host, self.port), timeout=5.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            body, self._sealer, self._opener = hello(secret, "rank", self.name, "", 0)
            sock.sendall(frame(self._sealer.seal(body)))
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            if json.loads(self._opener.open(recv_frame(sock, MAX_REQUEST))) != {"ok": "hello"}:
                raise ConnectionClosed("the store did not answer the HELLO")
        except BaseException:
            sock.close()
            raise
        return sock

    def _call(self, op: str, keys: list[str], values: tuple[bytes, ...] = (), n: int = 0,
              timeout: float | None = None) -> Any:
        wait_s = self.timeout.total_seconds() if timeout is None else timeout
        req = {"op": op, "keys": [f"{self.name}/{k}" for k in keys],
               "values": [_b64(v) for v in values], "n": n, "timeout": wait_s}
        with self._lock:
            try:
                self._sock.settimeout(wait_s + 5.0)
                self._sock.sendall(frame(self._sealer.seal(json.dumps(req).encode())))
                reply = json.loads(self._opener.open(recv_frame(self._sock, MAX_REQUEST)))
            except (OSError, ConnectionClosed, AuthFailed, ValueError) as e:
                raise dist.DistNetworkError(f"the store {self.host}:{self.port}: {op}: "
                                            f"{type(e).__name__}: {e}") from e
        if "error" in reply:
            raise dist.DistStoreError(f"the store {self.host}:{self.port}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        """Close the connection (and the server this process hosts)."""
        _close(self._sock, self.server)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", [key], (_bytes(value),))

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._call("get", [key]))

    def add(self, key: str, value: int) -> int:
        return self._call("add", [key], n=value)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", list(keys),
                   timeout=None if timeout is None else timeout.total_seconds())

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        return base64.b64decode(self._call("compare_set", [key], (_bytes(expected_value),
                                                                    _bytes(desired_value))))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", [key])

    def num_keys(self) -> int:
        return self._call("num_keys", [])


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _close(sock: socket.socket, server: StoreServer | None) -> None:
    sock.close()
    if server is not None:
        server.close()
