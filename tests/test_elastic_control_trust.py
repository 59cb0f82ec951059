"""The control plane answers only to the job (issue 28): what reaches an agent's port from
another process -- malformed frames, forged messages without the run's secret, replayed frames
-- never kills its event loop, evicts a member or adds a stranger.

The attacks are the ones that worked before (issue 28), sent over raw sockets to live agents
(`python -m oobleck_hpc.control.agent` with echo workers: test_elastic_control.Cluster)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time

import pytest
from helpers import wait_until
from test_elastic_control import SECRET, Cluster

from oobleck_hpc.control.auth import AuthFailed, Sealer, keys, load_secret
from oobleck_hpc.control.wire import NodeAddress, Roster, free_ports

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
    ("a 60 MB header, its body never sent", struct.pack("!I", 60 << 20) + b"x" * 1000),
]
AFTER_HELLO: list[tuple[str, bytes]] = [  # (sent by a member: authenticated, then malformed)
    ("EXCHANGE without xgen", json.dumps({"type": "exchange", "src": "x"}).encode()),
    ("a bare JSON string", json.dumps("hello").encode()),
    ("200,000 nested lists", b"[" * 200_000),
    ("DECIDED whose nodes are not names", json.dumps(
        {"type": "decided", "gen": 1, "nodes": [1], "lost": [], "store_node": "node0",
         "store_port": 1, "joined": []}).encode()),
    ("PROPOSE without a decision", json.dumps(
        {"type": "propose", "round": 1, "view": [], "port": 1, "reasons": {}}).encode()),
    ("BYE whose code is a string", json.dumps(
        {"type": "bye", "how": "abort", "code": "2", "reason": ""}).encode()),
]


class Speaker:
    """A connection to agent `to_name` at `to` that speaks the protocol (auth.py) as node
    `name` with `secret` (the run's: a member; another: a stranger who guessed); `keys_for`:
    derive the keys for another name; `ts`: the HELLO's clock. `sent`: every byte written."""

    def __init__(self, to: NodeAddress, name: str, secret: bytes, keys_for: str | None = None,
                 ts: float | None = None):
        self.sock = socket.create_connection((to.host, to.port), timeout=5)
        hello = {"type": "hello", "src": name, "to": to.name, "host": "127.0.0.1", "port": 1,
                 "nonce": os.urandom(16).hex(), "ts": time.time() if ts is None else ts}
        self.sealer = Sealer(keys(secret, hello["nonce"], keys_for or name, to.name)[0])
        self.sent = b""
        self.send(hello)

    def send(self, msg: object) -> None:
        self.send_body(json.dumps(msg).encode())

    def send_body(self, body: bytes) -> None:
        data = frame(self.sealer.seal(body))
        self.sent += data
        self.sock.sendall(data)

    def closed_by_peer(self, within_s: float = 2.0) -> bool:
        self.sock.settimeout(within_s)
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def run_secret(c: Cluster) -> bytes:
    return load_secret(c.run_dir / "secret")


@pytest.mark.timeout(120)
def test_malformed_frames_close_one_connection_and_never_the_event_loop(tmp_path):
    c = Cluster(tmp_path / "run", 3, workers=1)
    try:
        c.wait_workers(c.names, gen=0)
        for name, data in MALFORMED:
            for node in c.names:
                send_raw(c.agents.roster.address(node), data)
        for name, body in AFTER_HELLO:
            for i, node in enumerate(c.names):
                member = Speaker(c.agents.roster.address(node), c.names[i - 1], run_secret(c))
                member.send_body(body)
                assert member.closed_by_peer(), name
                member.close()
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
    from oobleck_hpc.control.plane import ControlPlane
    from oobleck_hpc.records.events import EventLog, read_events

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


def forged(n: list[str]) -> list[tuple[str, dict]]:
    """The messages that stopped, split or joined a job of nodes `n` from a stranger's
    connection (issue 28), each as the sender it poses as would send it."""
    d0 = {"gen": 0, "nodes": n, "lost": [], "store_node": n[0], "store_port": 1, "joined": []}
    fake = {**d0, "gen": 1, "nodes": n[:1], "lost": n[1:]}
    return [
        (n[1], {"type": "bye", "how": "abort", "code": 2, "reason": "forged"}),
        (n[1], {"type": "bye", "how": "early", "code": 3, "reason": "forged"}),
        (n[1], {"type": "bye", "how": "finished", "code": 0, "reason": "forged"}),
        (n[1], {"type": "failed", "how": "forged"}),
        (n[1], {"type": "report", "gen": 0, "node": n[2], "how": "lease_expired"}),
        (n[1], {"type": "propose", "round": 1, "view": n[:2], "port": 1, "decided": d0,
                "reasons": {n[2]: "forged"}, "readmits": []}),
        (n[1], {"type": "bye", "how": "withdraw", "code": 3, "reason": "forged"}),
        (n[1], {"type": "decided", **fake}),
        (n[1], {"type": "fence", "gen": 5, "nodes": [n[1]]}),
        (n[1], {"type": "exchange", "xgen": 0, "key": "step-1", "value": "forged"}),
        (n[1], {"type": "exchange_done", "xgen": 0, "key": "step-1", "values": {}}),
        ("mallory", {"type": "join", "how": "spare"}),
    ]


def plain_hello(poser: str, to: str) -> dict:
    return {"type": "hello", "src": poser, "to": to, "host": "127.0.0.1", "port": 1,
            "nonce": os.urandom(16).hex(), "ts": time.time()}


@pytest.mark.timeout(120)
def test_strangers_without_the_secret_change_nothing(tmp_path):
    """Every forged message of issue 28, sent to every agent by a stranger two ways -- plain
    frames as before authentication existed, and sealed with a wrong secret -- and 100 idle
    connections per agent held past the authentication deadline: every agent stays a member,
    nobody is added to a roster, and the job ends cleanly."""
    c = Cluster(tmp_path / "run", 3, workers=1)
    try:
        c.wait_workers(c.names, gen=0)
        wrong = os.urandom(32)
        sent = 0
        for node in c.names:
            to = c.agents.roster.address(node)
            for poser, msg in forged(c.names):
                if poser == node:
                    continue
                send_raw(to, jframe(plain_hello(poser, node)) + jframe({**msg, "src": poser}),
                         linger_s=0.05)
                stranger = Speaker(to, poser, wrong)
                stranger.send(msg)
                assert stranger.closed_by_peer(), (node, msg)
                stranger.close()
                sent += 2
        idle = [socket.create_connection((a.host, a.port)) for a in c.agents.roster.nodes
                for _ in range(100)]
        wait_until(lambda: len(c.events("frame_rejected")) >= sent, 10, "every frame rejected")
        time.sleep(2 * 2.0)  # two leases: a member crowded out, or stopped, would be gone by now
        closed = 0
        for sock in idle:  # (closed by their agent: past the deadline, or the oldest of too many)
            sock.settimeout(0.01)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                pass
            sock.close()
        assert closed == len(idle), f"{len(idle) - closed} idle strangers still open"
        assert_all_members(c, c.names)
        reasons = {e["reason"] for e in c.events("frame_rejected")}
        assert any("MAC does not verify" in r for r in reasons), reasons
        assert not any("mallory" in json.dumps(e) for e in c.events()
                       if e["kind"] != "frame_rejected")
        assert c.stop_all() == {m: 0 for m in c.names}, c.dump()
    finally:
        c.cleanup()


@pytest.mark.timeout(60)
def test_an_authentic_hello_is_taken_once_fresh_for_its_sender_and_its_addressee(tmp_path):
    """A member's authentic HELLO and HEARTBEAT, replayed byte for byte on another connection,
    are rejected (the nonce was seen); so are a HELLO sealed with another node's keys, one
    addressed to another node, and one whose clock is 10 minutes old."""
    c = Cluster(tmp_path / "run", 2, workers=1)
    try:
        c.wait_workers(c.names, gen=0)
        to = c.agents.roster.address("node0")
        secret = run_secret(c)
        member = Speaker(to, "node1", secret)
        member.send({"type": "heartbeat", "gen": 0})
        assert not member.closed_by_peer(0.3), "an authentic frame was rejected"
        assert send_raw(to, member.sent, linger_s=2.0) == b""
        member.send({"type": "unlink"})  # (closes without counting as a lost connection)
        member.close()
        # One bad speaker at a time: each connects once the one before was closed. (Built
        # together, two connected at once and the agent's rejections came in either order.)
        for bad in (lambda: Speaker(to, "node1", secret, keys_for="node0"),
                    lambda: Speaker(to, "node1", secret, ts=time.time() - 600),
                    lambda: Speaker(NodeAddress("node9", to.host, to.port), "node1", secret)):
            speaker = bad()
            assert speaker.closed_by_peer(), "a bad HELLO was accepted"
            speaker.close()
        wait_until(lambda: len(c.events("frame_rejected")) >= 4, 10, "all rejected")
        reasons = [e["reason"] for e in c.events("frame_rejected")]
        expected = ("HELLO from 'node1' replayed", "MAC does not verify", " s old",
                    "HELLO from another node to node0")
        assert len(reasons) == 4 and all(
            sum(x in r for r in reasons) == 1 for x in expected), reasons
        assert_all_members(c, c.names)
        assert c.stop_all() == {m: 0 for m in c.names}, c.dump()
    finally:
        c.cleanup()


def test_the_secret_file_is_private_kept_by_a_requeue_and_required(tmp_path, monkeypatch):
    from oobleck_hpc.records import runs
    from oobleck_hpc.errors import ConfigError

    monkeypatch.delenv("OOBLECK_SECRET_FILE", raising=False)
    runs.begin(tmp_path, "run-1")
    path = tmp_path / "secret"
    assert path.stat().st_mode & 0o777 == 0o600
    first = load_secret(path)
    assert len(first) == 32
    runs.begin(tmp_path, "run-1")  # a requeued attempt of the same run
    assert load_secret(path) == first
    runs.begin(tmp_path, "run-2")  # a new run: the old run's agents must not speak to it
    assert load_secret(path) != first and path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="others may read it"):
        load_secret(path)
    path.unlink()
    port = free_ports(1)[0]
    (tmp_path / "roster.json").write_text(json.dumps(
        {"nodes": [{"name": "a", "host": "127.0.0.1", "port": port}]}))
    r = subprocess.run([sys.executable, "-m", "oobleck_hpc.control.agent", "--node", "a", "--run-dir",
                        str(tmp_path), "--", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and str(path) in r.stderr, r.stderr


def test_sealed_frames_verify_once_in_order_and_cost_microseconds():
    from oobleck_hpc.control.auth import Replays

    nonce = os.urandom(16).hex()
    send, back = keys(SECRET, nonce, "node1", "node0")
    assert send != back and keys(SECRET, nonce, "node1", "node2")[0] != send
    a, b = Sealer(send), Sealer(send)
    bodies = [json.dumps({"type": "heartbeat", "gen": i, "src": "node1"}).encode() for i in range(3)]
    sealed = [a.seal(x) for x in bodies]
    assert b.open(sealed[0]) == bodies[0]
    with pytest.raises(AuthFailed):
        b.open(sealed[2])  # one skipped (or reordered)
    c = Sealer(send)
    assert c.open(sealed[0]) == bodies[0]
    with pytest.raises(AuthFailed):
        c.open(sealed[0])  # replayed on the same connection
    with pytest.raises(AuthFailed):
        Sealer(keys(SECRET, nonce, "node2", "node0")[0]).open(sealed[0])  # another sender
    replays, now = Replays(), time.time()
    hello = {"src": "node1", "nonce": nonce, "ts": now}
    replays.check(hello, now)
    with pytest.raises(AuthFailed, match="replayed"):
        replays.check(hello, now + 1)
    with pytest.raises(AuthFailed, match="old"):
        replays.check({**hello, "nonce": "x", "ts": now - 1000}, now)
    replays.check({**hello, "nonce": "y", "ts": now + 1000}, now + 1000)  # (prunes what can no longer pass)
    assert set(replays.seen) == {"y"}
    n, t = 20_000, time.perf_counter()
    seal, opener = Sealer(send), Sealer(send)
    for _ in range(n):
        opener.open(seal.seal(bodies[0]))
    us = (time.perf_counter() - t) / n * 1e6
    print(f"\n[figures] seal + open of a {len(bodies[0])}-byte frame: {us:.2f} us")
    assert us < 200  # (a loose bound for a loaded machine; typically a few us)
