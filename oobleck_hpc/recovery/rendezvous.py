"""Rendezvous helpers of the reconfigure driver: a generation's store, the arrival of every
rank, and the release of connections to a store whose host froze. Each wait gives way
(`Superseded`) as soon as the agents open a newer round (`abort()`), so no rank sits in an old
generation's rendezvous while its peers moved on.

The store and strangers (issue 28): the generation's store is the run's own (recovery/store.py),
not torch's TCPStore, which answers any client (get, set, add, delete_key and `list_keys`, which
lists every key: a stranger could read the ranks' gloo addresses and break a rendezvous). So:

- it listens only on the store node's roster address (`_listener`; left alone, a listener takes
  every interface);
- a client must prove the run's secret in its first frame, to this store by name
  (`store_prefix(secret, generation)`: "oobleck-" and 32 hex digits of HMAC-SHA256(the run's
  secret, b"oobleck store\0" + the generation in decimal), so a connection made for one
  generation's store is refused by another's), and every frame after it is authenticated;
  a stranger's connection is closed after a few KB or 2 s, and no key is read, listed or
  written by it;
- every key lives under that name (the store adds it), the driver's arrival counter and torch's
  own process-group keys alike. A worker that cannot read the secret never reaches a store:
  train.py reads it first (auth.run_secret: a ConfigError naming the file, exit 2).

The gloo/NCCL data plane is not authenticated: a stranger who reaches those ports needs no
store (README, "Security model").
"""

from __future__ import annotations

import datetime
import hmac
import os
import socket
import time
from typing import Sequence

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.polling import pause


def wait_arrivals(store, key: str, node: str, world_size: int, timeout_s: float,
                  abort=None) -> None:
    """Wait until all `world_size` ranks reached the store: each rank (one of `node`'s) adds 1
    to `key`, and to `key`/its node (`missing_nodes`). Superseded as soon as abort() says a
    newer round opened; TimeoutError after `timeout_s`."""
    store.add(f"{key}/{node}", 1)
    store.add(key, 1)
    since = time.monotonic()
    deadline = since + timeout_s
    while (arrived := store.add(key, 0)) < world_size:
        if abort is not None and abort():
            raise Superseded(f"a newer membership round opened while {arrived} of {world_size} "
                             f"ranks had reached the store")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} ranks reached the store "
                               f"within {timeout_s:.0f} s")
        pause(since)


def missing_nodes(store, key: str, nodes: Sequence[str], per_node: int) -> list[str]:
    """The nodes of `nodes` (`per_node` ranks each) some of whose ranks have not yet reached
    `wait_arrivals(store, key, ...)`: one store call per node."""
    return [n for n in nodes if store.add(f"{key}/{n}", 0) < per_node]


def store_prefix(secret: bytes, generation: int) -> str:
    """The name of generation `generation`'s store in the run whose secret is `secret`, and the
    prefix of its keys (module docstring): the same on every rank of the run, unguessable
    without the secret, and new for every generation."""
    tag = hmac.digest(secret, b"oobleck store\0" + str(generation).encode(), "sha256")
    return f"oobleck-{tag.hex()[:32]}"  # (the store adds "/" before each key)


def _listener(host: str, port: int) -> socket.socket:
    """A socket listening on host:port only (not on every interface)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's listener
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        import torch.distributed as dist

        raise dist.DistNetworkError(f"the store cannot listen on {host}:{port} "
                                    f"({e.strerror})") from e
    return sock


def open_store(host: str, port: int, is_master: bool, timeout_s: float, abort=None, *,
               secret: bytes, generation: int):
    """Generation `generation`'s store (an AuthStore, recovery/store.py; module docstring): the
    host creates it, listening on `host` only; a client connects on a helper thread while this
    one polls abort() and gives up (Superseded) as soon as a newer round opens. A client retries
    its connection until the store's timeout: a store host that dies between the agreement and
    the connection held a survivor for that long while the others had agreed on the next round
    (seen in CI, a second node lost during a recovery). A port taken is a DistNetworkError (a
    RuntimeError, like torch's own). The caller holds the returned store while process groups
    built on it live (store.py)."""
    from oobleck_hpc.recovery.store import AuthStore, StoreServer
    from oobleck_hpc.engine.groups import run_abortable

    timeout = datetime.timedelta(seconds=timeout_s)
    name = store_prefix(secret, generation)
    if is_master:
        server = StoreServer(_listener(host, port), secret, name)
        try:
            return AuthStore(host, server.sock.getsockname()[1], secret, name, timeout, server)
        except BaseException:
            server.close()
            raise

    def make():
        return AuthStore(host, port, secret, name, timeout)

    if abort is None:
        return make()

    def stop() -> BaseException | None:
        if abort():
            return Superseded(f"a newer membership round opened while connecting to the "
                              f"store {host}:{port}")
        return None

    return run_abortable(make, stop, 0.02, "store-connect")


def release_connections(host: str, port: int) -> int:
    """Shut down every TCP connection of this process to host:port; returns how many.

    A store client whose host froze (SIGSTOP, a hung node) waits for the reply of add() or of
    a rendezvous' get() up to the store's timeout (300 s in a job; torch's TCPStore waited for
    ever). After the shutdown the waiting call fails at once (a RuntimeError, like any failure
    of the regroup) and the rank goes on to the next round. Each descriptor is duplicated, the
    duplicate shut down and closed: the socket stays its owner's to close."""
    wanted = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    done = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        try:
            peer = sock.getpeername()
            if (isinstance(peer, tuple) and peer[1] == port
                    and peer[0].removeprefix("::ffff:") in wanted):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass  # not connected
        finally:
            sock.close()
    return done
