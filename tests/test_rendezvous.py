"""The rendezvous store and strangers (issue 28; elastic/rendezvous.py): the key prefix derived
from the run's secret, the listener bound to the store host's address, and what another
process's torch client can and cannot do there. One process, no training (the stranger during
a real run: tests/test_recovery.py, test_kill_store_host_and_coordinator)."""

from __future__ import annotations

import datetime
import re
import socket

import pytest

from oobleck_hpc.elastic.auth import SECRET_ENV, run_secret, write_secret
from oobleck_hpc.elastic.rendezvous import open_store, store_prefix
from oobleck_hpc.elastic.wire import free_port
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


@pytest.mark.timeout(60)
def test_a_stranger_on_the_store_finds_no_key_by_name_and_changes_none():
    """What rendezvous.py's docstring promises, against torch itself: the host listens on its
    address only; a stranger's client reads nothing under the names it can guess, and its
    writes there change no key of the run -- but it can list the keys (`list_keys`), prefix
    included, which is why the docstring does not call the prefix a secret from such a client."""
    import torch.distributed as dist

    prefix = store_prefix(SECRET, 4)
    port = free_port()
    host = open_store("127.0.0.1", port, True, 10.0, prefix=prefix)
    rank = open_store("127.0.0.1", port, False, 10.0, prefix=prefix)
    host.add("arrived", 1)
    rank.add("arrived", 1)
    rank.set("0//cpu//0/1", b"rank 1's address")
    with pytest.raises(ConnectionRefusedError):  # another address of this host
        socket.create_connection(("127.0.0.2", port), timeout=2).close()

    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=1))
    guesses = ["arrived", "0//cpu//0/1", "oobleck/gen4/arrived", "oobleck/gen4/0//cpu//0/1"]
    assert not stranger.check(guesses)
    with pytest.raises(dist.DistStoreError):  # (a get waits for the key: none comes)
        stranger.get("0//cpu//0/1")
    for key in guesses:
        stranger.set(key, b"garbage")
        stranger.add(key + "/n", -1000)
    stranger.delete_key("arrived")
    assert host.add("arrived", 0) == 2
    assert rank.get("0//cpu//0/1") == b"rank 1's address"

    listed = stranger.list_keys()  # the limit of the prefix (module docstring)
    assert f"{prefix}/arrived" in listed

    with pytest.raises(RuntimeError, match="cannot listen"):  # a port taken: torch's error kind
        open_store("127.0.0.1", port, True, 10.0, prefix=prefix)
