"""The rendezvous store and strangers (issue 28; recovery/rendezvous.py, recovery/store.py): the
store's name derived from the run's secret and the generation, its answers against torch's own
store, the listener bound to the store host's address, and strangers refused. One process, no training (the stranger during
a real run: tests/test_recovery.py, test_kill_store_host_and_coordinator)."""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import socket
import struct
import time

import pytest

from oobleck_hpc.control.auth import AUTH_DEADLINE_S, SECRET_ENV, hello, run_secret, write_secret
from oobleck_hpc.recovery.rendezvous import open_store, store_prefix
from oobleck_hpc.control.wire import frame, free_port
from oobleck_hpc.errors import ConfigError

SECRET = bytes(range(32))


def test_the_prefix_differs_per_secret_and_per_generation():
    prefixes = {store_prefix(secret, gen) for secret in (SECRET, SECRET[::-1], b"\0" * 32)
                for gen in (0, 1, 2, 10, 11, 101)}
    assert len(prefixes) == 18
    assert store_prefix(SECRET, 3) == store_prefix(bytes(SECRET), 3)  # the same on every rank
    for p in prefixes:
        assert re.fullmatch(r"oobleck-[0-9a-f]{32}", p), p
        assert SECRET.hex()[:16] not in p


def test_a_worker_without_the_secret_stops_naming_the_file(tmp_path, monkeypatch):
    """train.py reads the secret before anything touches a store: without it, a ConfigError
    (exit 2) that names the file it looked for."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "secret"))):
        run_secret(tmp_path)
    monkeypatch.setenv(SECRET_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "elsewhere"))):
        run_secret(tmp_path)
    write_secret(tmp_path, fresh=True)
    monkeypatch.delenv(SECRET_ENV)
    assert len(run_secret(tmp_path)) == 32


def _ops(rng: random.Random, n: int):
    """`n` random store operations on a few keys: (name, args)."""
    keys = ["a", "b", "c/d", "arrived"]
    values = [b"", b"1", b"x" * 300, bytes(range(256)), "text"]
    for _ in range(n):
        k = rng.choice(keys)
        op = rng.choice(["set", "add", "check", "compare_set", "delete_key", "num_keys", "get"])
        yield {"set": ("set", (k, rng.choice(values))), "add": ("add", (k, rng.randint(-3, 3))),
               "check": ("check", (rng.sample(keys, rng.randint(1, 3)),)),
               "compare_set": ("compare_set", (k, rng.choice(values + [b"2", b"x"]),
                                               rng.choice(values))),
               "delete_key": ("delete_key", (k,)), "num_keys": ("num_keys", ()),
               "get": ("get", (k,))}[op]


def _outcome(store, op: str, args):
    if op == "get" and not store.check([args[0]]):
        return "missing"  # (a get waits for its key)
    if op == "add" and store.check([args[0]]) and not re.fullmatch(rb"-?\d+", store.get(args[0])):
        return "not added"  # (torch's stores differ there: an error, 0, or a closed connection)
    return getattr(store, op)(*args)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(4))
def test_the_store_answers_as_torchs_own(seed):
    """The run's store (recovery/store.py) against torch's HashStore, the same random
    operations on both: the same answers, in the order given."""
    import torch.distributed as dist

    port = free_port()
    host = open_store("127.0.0.1", port, True, 10.0, secret=SECRET, generation=seed)
    rank = open_store("127.0.0.1", port, False, 10.0, secret=SECRET, generation=seed)
    oracle = dist.HashStore()
    for i, (op, args) in enumerate(_ops(random.Random(seed), 400)):
        store = (host, rank)[i % 2]
        assert _outcome(store, op, args) == _outcome(oracle, op, args), (i, op, args)
    with pytest.raises(dist.DistStoreError, match="timed out"):
        rank.wait(["never"], datetime.timedelta(seconds=0.2))
    with pytest.raises(NotImplementedError):
        rank.list_keys()  # not even for the run's own ranks
    host.close()
    with pytest.raises(dist.DistNetworkError):
        rank.add("a", 1)


def _hello_frame(secret: bytes, name: str) -> bytes:
    body, sealer, _ = hello(secret, "rank", name, "", 0)
    return frame(sealer.seal(body))


def _refused(payload: bytes, port: int) -> bool:
    """Whether the store closes a connection that sends `payload` without answering it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        return sock.recv(1 << 16) == b""


@pytest.mark.timeout(90)
def test_a_stranger_reaches_no_key_of_the_store():
    """A stranger on the store's port -- torch's own client, garbage, a HELLO unsealed or sealed
    with another secret or for another generation's store, a rank's HELLO replayed, oversized
    headers, 300 idle connections -- is closed without an answer; the run's keys stay as the
    ranks wrote them, and a rank still connects within a second meanwhile. The host listens on
    its own address only."""
    import torch.distributed as dist

    port = free_port()
    host = open_store("127.0.0.1", port, True, 10.0, secret=SECRET, generation=4)
    rank = open_store("127.0.0.1", port, False, 10.0, secret=SECRET, generation=4)
    host.add("arrived", 1)
    rank.add("arrived", 1)
    rank.set("0//cpu//0/1", b"rank 1's address")
    with pytest.raises(ConnectionRefusedError):  # another address of this host
        socket.create_connection(("127.0.0.2", port), timeout=2).close()

    with pytest.raises(RuntimeError):
        dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=1)).get("arrived")
    name = store_prefix(SECRET, 4)
    replayed = _hello_frame(SECRET, name)
    assert not _refused(replayed, port)  # (the first time: a rank's own)
    for payload in [replayed, b"\x00garbage" * 100, os.urandom(3000),
                    frame(b"\0" * 32 + json.dumps({"type": "hello", "src": "x", "to": name,
                                                   "host": "", "port": 0, "nonce": "n",
                                                   "ts": 1.0}).encode()),
                    _hello_frame(SECRET[::-1], name), _hello_frame(SECRET, store_prefix(SECRET, 3)),
                    struct.pack("!I", 60 << 20) + b"x" * 1000]:
        assert _refused(payload, port), payload[:40]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    t0 = time.monotonic()
    late = open_store("127.0.0.1", port, False, 10.0, secret=SECRET, generation=4)
    assert late.add("arrived", 1) == 3 and time.monotonic() - t0 < 1.0
    time.sleep(AUTH_DEADLINE_S + 0.5)
    for sock in idle:  # each closed by the store: the oldest for newer ones, the rest in time
        sock.settimeout(1.0)
        assert sock.recv(16) == b""
        sock.close()
    assert rank.get("0//cpu//0/1") == b"rank 1's address"
    assert host.num_keys() == 2
    assert host.server.rejected >= 300 + 8

    with pytest.raises(RuntimeError, match="cannot listen"):  # a port taken: torch's error kind
        open_store("127.0.0.1", port, True, 10.0, secret=SECRET, generation=5)
