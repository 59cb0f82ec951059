"""Rendezvous helpers of the reconfigure driver: a generation's TCPStore, the arrival of every
rank, and the release of connections to a store whose host froze. Each wait gives way
(`Superseded`) as soon as the agents open a newer round (`abort()`), so no rank sits in an old
generation's rendezvous while its peers moved on.

The store and strangers (issue 28). torch's TCPStore authenticates nobody: whoever reaches its
port is a client with every right (get, set, add, compare_set, delete_key, wait, num_keys and
`list_keys`, which lists every key of the store). So:

- it listens only on the store node's roster address (`open_store` binds the listening socket
  itself and hands it to torch, `master_listen_fd`; left alone, torch listens on every
  interface);
- every key the run uses -- the driver's arrival counter and torch's own process-group keys
  alike -- lives under `store_prefix(secret, generation)`: "oobleck-" and 32 hex digits of
  HMAC-SHA256(the run's secret, b"oobleck store\0" + the generation in decimal). `open_store`
  returns the store already wrapped in that PrefixStore; the bare TCPStore is never handed out.
  A worker that cannot read the secret never reaches the store: train.py reads it first
  (auth.run_secret: a ConfigError naming the file, exit 2).

What a stranger who reaches the port can and cannot do, then (torch 2.13):

- it CAN connect, and read and write keys under names it invents (`get`, `set`, `add`, values of
  any size: the store host's memory is not bounded), and count the keys (`num_keys`);
- it CANNOT find a rendezvous key by guessing its name: the names torch and an un-prefixed run
  use ("oobleck/gen0/arrived", "oobleck/gen0//0//cpu//0/1", ...) are not there, the prefix
  differs per run and per generation, and 128 bits are not guessed -- so it cannot read them,
  nor overwrite, add to or delete them, by name;
- but it CAN LIST them: `TCPStore.list_keys()` answers any client with every key, the prefix
  included. Having listed them, a stranger can read what they hold (the ranks' gloo
  addresses; with NCCL, the communicators' unique ids) and overwrite or delete a rendezvous
  key: the rendezvous then fails (a retry round, and at worst the checkpoint fallback) or a
  rank connects its gloo pair to an address the stranger chose. The prefix stops blind
  writers (another job's torch clients, a stale worker of an earlier run or generation on a
  reused port), not a client that reads the store's listing; only a store that authenticates
  its clients would, and torch's does not. The gloo/NCCL data plane is not authenticated
  either: a stranger who reaches those ports needs no store.

torch APIs: TCPStore (public: constructor with is_master / wait_for_workers / timeout /
master_listen_fd, add), PrefixStore.
"""

from __future__ import annotations

import datetime
import hmac
import os
import socket
import time

from oobleck_hpc.elastic.membership import Superseded


def wait_arrivals(store, key: str, world_size: int, timeout_s: float, abort=None) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(key, 0)) < world_size:
        if abort is not None and abort():
            raise Superseded(f"a newer membership round opened while {arrived} of {world_size} "
                             f"ranks had reached the store")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} ranks reached the store "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.02)


def store_prefix(secret: bytes, generation: int) -> str:
    """The key prefix of generation `generation`'s store in the run whose secret is `secret`
    (module docstring): the same on every rank of the run, unguessable without the secret, and
    new for every generation."""
    tag = hmac.digest(secret, b"oobleck store\0" + str(generation).encode(), "sha256")
    return f"oobleck-{tag.hex()[:32]}"  # (PrefixStore adds "/" before each key)


def _listener(host: str, port: int) -> socket.socket:
    """A socket listening on host:port only (torch's own would listen on every interface)."""
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
               prefix: str):
    """Generation store, under `prefix` (`store_prefix`; module docstring): the host creates it,
    listening on `host` only; a client connects on a helper thread while this one polls abort()
    and gives up (Superseded) as soon as a newer round opens. torch retries a client's
    connection until the store's timeout and cannot be interrupted: a store host that dies
    between _wait_port and the connection held a survivor for that long while the others had
    agreed on the next round (seen in CI, a second node lost during a recovery). A port taken
    is a DistNetworkError (a RuntimeError, like torch's own)."""
    import torch.distributed as dist

    from oobleck_hpc.engine.groups import run_abortable

    timeout = datetime.timedelta(seconds=timeout_s)

    def make():
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timeout)

    if is_master:
        sock = _listener(host, port)
        try:
            store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                                  wait_for_workers=False, timeout=timeout,
                                  master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()  # (torch leaves the descriptor open when it refuses it)
            raise
        sock.detach()  # the store's now: it closes it
    elif abort is None:
        store = make()
    else:
        def stop() -> BaseException | None:
            if abort():
                return Superseded(f"a newer membership round opened while connecting to the "
                                  f"store {host}:{port}")
            return None

        store = run_abortable(make, stop, 0.02, "store-connect")
    return dist.PrefixStore(prefix, store)


def release_connections(host: str, port: int) -> int:
    """Shut down every TCP connection of this process to host:port; returns how many.

    A TCPStore client whose host froze (SIGSTOP, a hung node) waits for the reply of add() or
    of a rendezvous' get() for ever: the store's timeout does not bound it (measured with torch
    2.13: add() still blocked after 20 s on a 3 s store). After the shutdown the waiting call
    fails at once (a RuntimeError, like any failure of the regroup) and the rank goes on to the
    next round. Each descriptor is duplicated, the duplicate shut down and closed: the socket
    stays torch's to close."""
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


def wait_port(host: str, port: int, timeout_s: float, abort=None) -> None:
    """Until host:port accepts connections; Superseded as soon as abort() (a newer round: the
    host may have moved on and will never open this store)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if abort is not None and abort():
            raise Superseded(f"a newer membership round opened while waiting for the store "
                             f"{host}:{port}")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.005)
