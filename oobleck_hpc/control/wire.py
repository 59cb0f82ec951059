"""Messages on the control plane and on the agent <-> worker link, and the node roster.

Framing: every message is a JSON object (a dict with a "type" key), sent as a 4-byte big-endian
length followed by that many bytes of UTF-8 JSON. The same framing is used between agents (TCP)
and between an agent and its workers (a socketpair inherited by the worker). Stdlib only.

The roster is the job's node list, written by the launcher (local launcher: by the parent
process; Slurm: by the bootstrap discovery) as JSON, and extended by nodes grown into the running
job (`oobleck-hpc grow`), which come last, as spares:

    {"nodes": [{"name": "node0", "host": "10.0.0.1", "port": 29400}, ...],
     "store_port": 29500}

Node order is meaningful: it is the job's initial node order (the `faults[].node` index), and
"lowest" node always means first in roster order. `store_port` is the port of generation 0's
rendezvous store, hosted by the first node (default: the first node's port + 1).
"""

from __future__ import annotations

import functools
import json
import random
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.files import write_json

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 * 1024 * 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or died): no more messages will come."""


def encode_body(msg: dict[str, Any]) -> bytes:
    """`msg` as compact JSON (a frame's body)."""
    return json.dumps(msg, separators=(",", ":"), default=str).encode()


def frame(payload: bytes) -> bytes:
    """`payload` framed: its length, then itself."""
    return _HEADER.pack(len(payload)) + payload


def encode_msg(msg: dict[str, Any]) -> bytes:
    """`msg` framed: its length, then its JSON."""
    return frame(encode_body(msg))


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode_msg(msg))


def decode_frames(buf: bytearray, limit: int = MAX_MESSAGE, most: int = -1) -> list[bytes]:
    """The bodies of the whole frames at the start of `buf` (a non-blocking reader's bytes so
    far; at most `most` of them if >= 0), removed from it; a partial frame stays. Raises
    ConnectionClosed on a length above `limit` (a corrupt stream, or more than the reader
    accepts yet)."""
    bodies: list[bytes] = []
    while len(buf) >= _HEADER.size and len(bodies) != most:
        (size,) = _HEADER.unpack_from(buf)
        if size > limit:
            raise ConnectionClosed(f"message of {size} bytes exceeds {limit}: corrupt stream")
        if len(buf) < _HEADER.size + size:
            break
        bodies.append(bytes(buf[_HEADER.size:_HEADER.size + size]))
        del buf[:_HEADER.size + size]
    return bodies


def recv_frame(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """The next frame's body (a blocking reader); raises ConnectionClosed at end of stream or
    on a length above `limit`."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise ConnectionClosed(f"message of {size} bytes exceeds {limit}: corrupt stream")
    return _recv_exact(sock, size)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """The next message; raises ConnectionClosed at end of stream."""
    return json.loads(recv_frame(sock))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class NodeAddress:
    name: str
    host: str
    port: int


@dataclass(frozen=True)
class Roster:
    """The job's nodes, in order, with the address of each node's agent; the last `spares` of
    them are spares (outside generation 0 until a round swaps them in: membership.py, step 7)."""

    nodes: tuple[NodeAddress, ...]
    store_port: int
    spares: int = 0

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @functools.cached_property
    def _by_name(self) -> dict[str, NodeAddress]:
        return {n.name: n for n in self.nodes}

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def members0(self) -> tuple[str, ...]:
        """Generation 0's nodes: all but the spares."""
        return self.names[:len(self.nodes) - self.spares]

    def with_node(self, node: NodeAddress) -> Roster:
        """This roster and `node` after it, outside generation 0 (a node grown into a running
        job joins like a spare: membership.py, step 7)."""
        if node.name in self:
            raise ValueError(f"node {node.name!r} is already in the roster")
        return Roster(self.nodes + (node,), self.store_port, self.spares + 1)

    def address(self, name: str) -> NodeAddress:
        return self._by_name[name]

    def order(self, names: Any) -> tuple[str, ...]:
        """`names` sorted in roster order (the canonical order of every view)."""
        wanted = set(names)
        return tuple(n for n in self.names if n in wanted)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [{"name": n.name, "host": n.host, "port": n.port} for n in self.nodes],
                "store_port": self.store_port, "spares": self.spares}

    def write(self, path: str | Path) -> None:
        """Write atomically (a reader never sees half a roster)."""
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, source: str = "<roster>") -> Roster:
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
            raise ConfigError(source, "nodes", f"is missing or empty in {str(data)[:80]!r}",
                              'write {"nodes": [{"name": ..., "host": ..., "port": ...}, ...]}')
        nodes = []
        for i, entry in enumerate(data["nodes"]):
            if not isinstance(entry, dict) or set(entry) != {"name", "host", "port"}:
                raise ConfigError(source, f"nodes[{i}]", f"value {entry!r} is not a node entry",
                                  'give exactly {"name": str, "host": str, "port": int}')
            if not isinstance(entry["port"], int) or not 0 < entry["port"] < 65536:
                raise ConfigError(source, f"nodes[{i}].port", f"value {entry['port']!r} is not a port",
                                  "use an integer in 1..65535")
            nodes.append(NodeAddress(str(entry["name"]), str(entry["host"]), entry["port"]))
        names = [n.name for n in nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(source, "nodes", f"names {dupes} appear more than once",
                              "give every node a unique name")
        store_port = data.get("store_port", nodes[0].port + 1)
        if not isinstance(store_port, int) or not 0 < store_port < 65536:
            raise ConfigError(source, "store_port", f"value {store_port!r} is not a port",
                              "use an integer in 1..65535")
        spares = data.get("spares", 0)
        if not isinstance(spares, int) or not 0 <= spares < len(nodes):
            raise ConfigError(source, "spares", f"value {spares!r} is not a count of spare nodes "
                              f"below the {len(nodes)} nodes", "use an integer from 0 to "
                              f"{len(nodes) - 1} (the last nodes of the list are the spares)")
        return cls(tuple(nodes), store_port, spares)

    @classmethod
    def load(cls, path: str | Path) -> Roster:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ConfigError(str(path), "<file>", f"cannot be read ({e.strerror})",
                              "pass the roster file written by the launcher") from e
        except json.JSONDecodeError as e:
            raise ConfigError(str(path), "<file>", f"is not valid JSON ({e})",
                              "regenerate the roster file") from e
        return cls.from_dict(data, source=str(path))


def join_roster_file(path: str | Path, node: str, host: str) -> tuple[str, Roster]:
    """Add this node to the roster file of a running job, as a grown node (`Roster.with_node`:
    it joins like a spare), with `host` and a free port; returns (its name, the new roster).
    For agents of a replacement job (launch/slurm.py), which start after the job's discovery:
    the file is updated under an exclusive lock (several replacements may start at once, on a
    shared filesystem that honours flock) and atomically (the job's other readers). A name
    already in the roster -- the node was lost and given back to this job -- gets a suffix
    (`n4~2`): a name excluded once never comes back (membership.py)."""
    import fcntl

    path = Path(path)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        roster = Roster.load(path)
        name, k = node, 1
        while name in roster.names:
            k += 1
            name = f"{node}~{k}"
        roster = roster.with_node(NodeAddress(name, host, free_port(host)))
        roster.write(path)
    return name, roster


# Ports we hand out for others to bind later (agents, stores) come from above this floor and
# outside the kernel's ephemeral range: every bind-to-0 and every outgoing connection on the host
# (srun's I/O listeners, gloo's pairs, Slurm's daemons) gets an ephemeral port, so none of them
# can take ours between our pick and the binder's bind. Seen before this rule: the agents' srun
# bound the port discovery had just picked for the agent on the same host (exit 2).
PORT_FLOOR = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK = random.SystemRandom()  # not the process's (possibly seeded) generator: pickers must differ


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _EPHEMERAL.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _handed_out_ports() -> list[range]:
    """The ports reserve_port picks from: above PORT_FLOOR, below or above the ephemeral range."""
    lo, hi = _ephemeral_range()
    return [r for r in (range(PORT_FLOOR, min(lo, 65536)), range(max(hi + 1, PORT_FLOOR), 65536))
            if len(r)]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free TCP port on `host`, outside the ephemeral range (above). The
    port is picked at random and bound without SO_REUSEADDR, so that a port in any use is skipped
    and two concurrent pickers rarely meet; where the ephemeral range leaves no room, the OS
    picks. Keep it open until the port is handed on and close it just before the binder binds
    (a socket that never listened leaves no TIME_WAIT behind)."""
    ranges = _handed_out_ports()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for _ in range(256 if ranges else 0):
            (port_range,) = _PICK.choices(ranges, weights=[len(r) for r in ranges])
            port = _PICK.choice(port_range)
            try:
                sock.bind((host, port))
                return sock
            except OSError:
                continue
        sock.bind((host, 0))
        return sock
    except BaseException:
        sock.close()
        raise


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago on `host` (reserve_port's rule, all
    held until all are picked). The caller (or the process it tells) binds them soon after; the
    binder reports a port taken in between. The package's one free-port helper (stdlib only)."""
    held = [reserve_port(host) for _ in range(count)]
    try:
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
