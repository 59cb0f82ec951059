"""This rank's part in a generation (the agents' decided membership): rendezvous on its store
and build the plan's groups, drop them, and notice at once when
the agents open a newer round (the engine's phase hook, the agent link's notices), so no rank
stays in a generation its peers left. Functions of the driver's state (recovery/state.py).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import TYPE_CHECKING, Any

from oobleck_hpc.recovery.rendezvous import (missing_nodes, open_store, release_connections,
                                              wait_arrivals)
from oobleck_hpc.recovery.stall import watched

if TYPE_CHECKING:
    from oobleck_hpc.control.client import Membership
    from oobleck_hpc.engine import Comm, PlanGroups
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.recovery.state import DriverState


class RoundOpened(Exception):
    """Raised from the engine's on_phase hook when the agents opened a membership round."""


def round_opened(s: DriverState) -> bool:
    """The agents opened a membership round (or decided one) past this generation."""
    r = s.client.round_open
    m = s.client.membership
    return (r is not None and r["gen"] > s.gen) or (m is not None and m.gen > s.gen)


def only_joins(s: DriverState) -> bool:
    """The round opened past this generation adds nodes and suspects none (membership.py, 7b:
    a round opened at a step boundary), as far as this rank heard."""
    r = s.client.round_open
    if r is not None:
        return r["joins_only"]
    m = s.client.membership
    return m is not None and m.gen == s.gen + 1 and not m.lost and bool(m.joined)


def on_phase(s: DriverState, phase: str, step: int) -> None:
    """The engine's hook between the phases of a step: injected faults, and RoundOpened when
    a round opened before the vote (past it a step commits whatever happens: driver.py)."""
    if s.faults is not None:
        s.faults(phase, step + 1)  # the engine's step index; faults count from 1
    if phase not in ("optimizer", "commit") and round_opened(s):
        r = s.client.round_open
        raise RoundOpened(f"membership round opened (suspects: "
                          f"{r['suspects'] if r else 'decided'})")


def on_notice(s: DriverState, kind: str, msg: dict[str, Any]) -> None:
    """AgentClient callback (on the agent link's thread) when a round opens: shut down the
    connection to an older generation's store (a store op waiting on a frozen host would
    never return: `release_connections`), and abort this generation's NCCL communicators
    (`Comm.abort`: pending collectives fail at once; idempotent, and harmless when the
    groups are already gone); gloo relies on the engine's abortable waits and on failed
    peers dropping their groups."""
    at = s.store_at
    if kind == "round" and at is not None and at[0] < msg.get("gen", 0):
        release_connections(at[1], at[2])
    comm = s.comm  # read once: the training thread may drop it meanwhile
    if kind == "round" and comm is not None and comm.generation < msg.get("gen", 0):
        comm.abort()


def regroup(s: DriverState, m: Membership, plan: Plan,
            timeout_s: float) -> tuple[Comm, PlanGroups]:
    """Rendezvous on generation `m.gen`'s store and build the plan's groups (`s.comm` is the
    new communicator from then on; the caller keeps the groups).

    Every rank first waits, up to `timeout_s`, until all ranks of the plan reached the store
    (Superseded as soon as a newer round opens). torch bounds a process group's rendezvous by
    the collective timeout, short on purpose; without this wait, ranks arriving seconds apart
    time out: at generation 0 those still importing torch on a loaded machine, later a
    survivor still stuck for a collective timeout in the previous, failed rendezvous while
    the others already started the next one (each then gives up on the other). A rank that
    died instead never arrives; its loss opens a newer round, which ends the wait at once. A
    rank that hung never arrives either, and nothing else sees it: past a stall's threshold
    the waiting ranks name its node (recovery/stall.py, `watched`), whose agent is probed; so
    do the ranks that wait to connect to the store, for its host's node (chaos seed 5205,
    trial 24: the store's host hung right before the rendezvous and held the others for its
    3.3 s lease).
    """
    from oobleck_hpc.engine import Comm, PlanGroups, default_backend
    from oobleck_hpc.engine.tied import tied_layers

    rank = plan.rank_of(s.node, s.local_rank)
    host = s.client.hosts_store(m)
    abort = partial(round_opened, s)
    recovery = m.gen > 0  # (a start's ranks import torch at their own pace: left to the lease)
    connect_abort = (watched(s, m.gen, "the store's connect", lambda: [m.store_node], abort)
                     if recovery else abort)
    old = s.store
    s.store = open_store(m.store_host, m.store_port, host, timeout_s, connect_abort,
                         secret=s.secret, generation=m.gen)
    s.store_at = None if host else (m.gen, m.store_host, m.store_port)
    del old
    if recovery:
        late = partial(missing_nodes, s.store, "arrived", plan.nodes, plan.gpus_per_node)
        abort = watched(s, m.gen, "the rendezvous", late, abort)
    wait_arrivals(s.store, "arrived", s.node, plan.world_size, timeout_s, abort)
    comm = Comm.init(s.store, rank, plan.world_size, m.gen, default_backend(s.device.type),
                     s.timeout_s, device=s.device, init_timeout_s=timeout_s)
    s.comm = comm
    try:
        groups = PlanGroups.build(plan, comm, tied_layers(s.model))
    except BaseException:
        teardown(s)
        raise
    return comm, groups


def teardown(s: DriverState, clean: bool = False) -> None:
    """Drop this generation's groups: after a failure without waiting for the collectives
    still in flight (Comm.abandon), at the end of the run cleanly (Comm.destroy)."""
    if s.comm is not None:
        try:
            if clean:
                s.comm.destroy()
            else:
                s.comm.abandon()
        except Exception as e:  # a broken group still goes away
            print(f"[{s.node}/{s.local_rank}] destroying generation {s.gen}: {e!r}",
                  file=sys.stderr, flush=True)
        s.comm = None
