"""Rendezvous helpers of the reconfigure driver: a generation's TCPStore, the arrival of every
rank, and the release of connections to a store whose host froze. Each wait gives way
(`Superseded`) as soon as the agents open a newer round (`abort()`), so no rank sits in an old
generation's rendezvous while its peers moved on.

torch APIs: TCPStore (public: constructor with is_master / wait_for_workers / timeout, add).
"""

from __future__ import annotations

import datetime
import os
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


def open_store(host: str, port: int, is_master: bool, timeout_s: float, abort=None):
    """Generation store: the host creates it; a client connects on a helper thread while this
    one polls abort() and gives up (Superseded) as soon as a newer round opens. torch retries a
    client's connection until the store's timeout and cannot be interrupted: a store host that
    dies between _wait_port and the connection held a survivor for that long while the others
    had agreed on the next round (seen in CI, a second node lost during a recovery)."""
    import torch.distributed as dist

    from oobleck_hpc.engine.groups import run_abortable

    def make():
        return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    if is_master or abort is None:
        return make()

    def stop() -> BaseException | None:
        if abort():
            return Superseded(f"a newer membership round opened while connecting to the store "
                              f"{host}:{port}")
        return None

    return run_abortable(make, stop, 0.02, "store-connect")


def release_connections(host: str, port: int) -> int:
    """Shut down every TCP connection of this process to host:port; returns how many.

    A TCPStore client whose host froze (SIGSTOP, a hung node) waits for the reply of add() or
    of a rendezvous' get() for ever: the store's timeout does not bound it (measured with torch
    2.13: add() still blocked after 20 s on a 3 s store). After the shutdown the waiting call
    fails at once (a RuntimeError, like any failure of the regroup) and the rank goes on to the
    next round. Each descriptor is duplicated, the duplicate shut down and closed: the socket
    stays torch's to close."""
    import socket

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
    import socket

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
