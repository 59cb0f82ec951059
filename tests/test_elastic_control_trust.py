"""The control plane answers only to the job (issue 28): what reaches an agent's port from
another process -- malformed frames, forged messages without the run's secret, replayed frames
-- never kills its event loop, evicts a member or adds a stranger.

The attacks are the ones that worked before (issue 28), sent over raw sockets to live agents
(`python -m oobleck_hpc.agent` with echo workers: test_elastic_control.Cluster)."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest
from helpers import wait_until
from test_elastic_control import Cluster

from oobleck_hpc.elastic.wire import NodeAddress, Roster, free_ports
from test_elastic_control import SECRET

pytestmark = pytest.mark.slow


def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def jframe(msg: object) -> bytes:
    return frame(json.dumps(msg).encode())


def send_raw(addr: NodeAddress, data: bytes, linger_s: float = 0.3) -> bytes:
    """Connect to an agent, send `data`, wait a moment; returns what the agent sent back (b""
    if nothing) once it closed the connection or `linger_s` passed."""
    got = b""
    with socket.create_connection((addr.host, addr.port), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(linger_s)
        try:
            while chunk := sock.recv(1 << 16):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def assert_all_members(c: Cluster, names: list[str]) -> None:
    """Every agent runs, none suspected anyone, none fenced, none's event loop died."""
    assert {m: p.poll() for m, p in c.procs.items()} == {m: None for m in names}, c.dump()
    bad = c.events("failure_detected") + c.events("fenced") + c.events("control_loop_died") \
        + c.events("peer_added")
    assert not bad, c.dump()


MALFORMED: list[tuple[str, bytes]] = [
    ("an empty list as the first message", jframe([])),
    ("HELLO whose src is a list", jframe({"type": "hello", "src": ["x"], "host": "h", "port": 1})),
    ("200,000 nested lists", frame(b"[" * 200_000)),
    ("a bare JSON string", jframe("hello")),
    ("not UTF-8", frame(b"\xff\xfe\x00garbage")),
    ("an unknown type", jframe({"type": "hello!", "src": "x"})),
    ("a length over the limit", struct.pack("!I", 0xFFFFFFFF) + b"x" * 100),
]
AFTER_HELLO: list[tuple[str, bytes]] = [
    ("EXCHANGE without xgen", jframe({"type": "exchange", "src": "x"})),
    ("a bare JSON string", jframe("hello")),
    ("DECIDED whose nodes are not names", jframe({"type": "decided", "gen": 1, "nodes": [1],
                                                   "lost": [], "store_node": "node0",
                                                   "store_port": 1, "joined": []})),
    ("PROPOSE without a decision", jframe({"type": "propose", "round": 1, "view": [],
                                           "port": 1, "reasons": {}})),
    ("BYE whose code is a string", jframe({"type": "bye", "how": "abort", "code": "2",
                                           "reason": ""})),
]


def hello_as(c: Cluster, node: str, to: str) -> bytes:
    """The first frame of a connection from member `node` to member `to`."""
    a = c.agents.roster.address(node)
    return jframe({"type": "hello", "src": node, "host": a.host, "port": a.port})


@pytest.mark.timeout(120)
def test_malformed_frames_close_one_connection_and_never_the_event_loop(tmp_path):
    c = Cluster(tmp_path / "run", 3, workers=1)
    try:
        c.wait_workers(c.names, gen=0)
        for name, data in MALFORMED:
            for node in c.names:
                send_raw(c.agents.roster.address(node), data)
        for name, data in AFTER_HELLO:
            for i, node in enumerate(c.names):
                other = c.names[i - 1]
                send_raw(c.agents.roster.address(node), hello_as(c, other, node) + data)
        expected = (len(MALFORMED) + len(AFTER_HELLO)) * len(c.names)
        wait_until(lambda: len(c.events("frame_rejected")) >= expected, 10,
                   "every malformed frame rejected")
        assert len(c.events("frame_rejected")) == expected, c.dump()
        time.sleep(3 * 2.0)  # over a lease: a node whose loop had died would be evicted by now
        assert_all_members(c, c.names)
        assert c.stop_all() == {m: 0 for m in c.names}, c.dump()
    finally:
        c.cleanup()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_event_loop_that_dies_fences_its_node_at_once(tmp_path):
    """A bug in the loop (here: a timer that raises) fences the node: its agent exits, and its
    peer sees the loss within a second (its port refuses), not after the lease."""
    from oobleck_hpc.elastic.control import ControlPlane
    from oobleck_hpc.elastic.events import EventLog, read_events

    pa, pb, store = free_ports(3)
    roster = Roster((NodeAddress("a", "127.0.0.1", pa), NodeAddress("b", "127.0.0.1", pb)), store)
    log = tmp_path / "events.jsonl"
    cps = {m: ControlPlane(m, roster, secret=SECRET, heartbeat_s=0.1, lease_s=30.0, startup_s=10, quorum="none",
                           events=EventLog(log, source=m)) for m in roster.names}
    try:
        for cp in cps.values():
            cp.start()
        deadline = time.time() + 10
        while not all(cp.detector.last_heard for cp in cps.values()):
            assert time.time() < deadline, "the two planes never heard from each other"
            time.sleep(0.02)

        def bug() -> None:
            raise KeyError("a bug in a handler")

        loop = cps["b"]._loop
        assert loop is not None
        loop.after(0.0, bug)
        t = time.monotonic()
        while "b" not in cps["a"].core.suspects:
            assert time.monotonic() - t < 2.0, f"b's loss was not seen: {read_events(log)}"
            time.sleep(0.01)
        loop.thread.join(timeout=2.0)
        assert not loop.thread.is_alive()
        assert cps["b"].fenced is not None and "event loop died" in cps["b"].fenced
        assert [e["source"] for e in read_events(log) if e["kind"] == "control_loop_died"] == ["b"]
        assert cps["a"]._loop is not None and cps["a"]._loop.thread.is_alive()
    finally:
        for cp in cps.values():
            cp.close()
