"""Process groups: one world per generation, and the plan's groups, deduplicated by rank set.

Lifecycle (the elastic layer relies on exactly this):

    comm = Comm.init(store, rank, world_size, generation, backend, timeout_s, device)
    groups = PlanGroups.build(plan, comm, tied_layers(model))  # every distinct rank set, once
    ... train ...
    comm.destroy()                            # a clean end: destroys the world and every subgroup
    comm.abandon()                            # after a failure: drop them at once (see there)

`init` wraps the caller's store in a `PrefixStore("oobleck/gen<generation>/")`, so a rebuilt
world never reads keys left by an older one (torchft does the same; the generation number comes
from the agents' agreement, one decision per generation; the elastic driver's store is itself
the generation's, open to the run's ranks only: recovery/store.py). After `destroy` or `abandon` nothing
of the old groups is left in torch.distributed; the same processes can `init` a new generation
with a different world size and rank. The collective timeout is short (the job's
`fault_tolerance.collective_timeout_s`): it bounds how long a hung peer can stall anything.

Which groups a plan needs: the sets of ranks that hold the same layers (`plan.layer_owners`).
A layer's holders are all replicas of its stage in every pipeline (in-node GPUs of a multi-GPU
stage included), so ONE all-reduce over that set sums both the in-node data-parallel shares and
the pipelines' contributions. Layers with identical holder sets share a group and a flat buffer.
Point-to-point traffic uses the default group. Every rank creates every group, in the same
(sorted) order, as `new_group` requires.

NCCL (GPUs). Communicators are created eagerly, bound to the rank's device (`device_id` of
`init_process_group` and `new_group`), while the regroup's long timeout (`init_timeout_s`)
applies; every group's collective timeout is then set to the short one (`set_timeout`). So the
first collective after a regroup never pays for communicator creation against the collective
timeout. Async error handling is CleanUpOnly (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, unless the
environment chose): a timed-out collective aborts its communicator and fails its work, it never
takes the process down -- a survivor must outlive the groups of a generation it gave up.
After a failure `abandon()` ABORTS every communicator of the generation (`ProcessGroup.abort()`)
before dropping the groups; `abort()` alone (the elastic layer, from the agent link's thread,
when a round opens) does the same without touching the registry, and is safe to call twice or
after the groups are gone. Waits on NCCL work never block the CPU or start a thread
(`Waiter.wait`: a stream dependency; the step's last all-reduce is polled with
`Work.is_completed()`).

gloo (CPU). A gloo wait cannot be interrupted and its point-to-point works never report
`is_completed()`: `Waiter` runs the blocking wait on ONE helper thread, reused wait after wait,
while the caller polls its abort condition; a wait given up leaves that thread stuck until the
collective timeout, and the next wait gets a fresh one. Nor can a group's connect be
interrupted: every gloo group is created with a connect timeout that bounds it by the collective
timeout (`gloo_connect_timeout`), then given its own. `abandon()` cannot abort gloo pairs: it
unregisters the groups without shutting them down and keeps them referenced, so that no
destructor blocks; their pending work fails at its own timeout, in the background.

torch.distributed APIs this module relies on (torch 2.13 - 2.14), public unless marked:
init_process_group(store=, device_id=, timeout=), new_group(ranks, timeout=, backend=,
device_id=), PrefixStore, destroy_process_group, is_initialized, group.WORLD, Work.wait /
is_completed / exception, ProcessGroup.abort / set_timeout (public methods, documented as
experimental for NCCL); PRIVATE: `distributed_c10d._world` (its pg_map, pg_names, pg_group_ranks,
pg_backend_config, pg_to_tag, tags_to_pg, pg_coalesce_state, group_count),
`distributed_c10d._update_default_pg` and `distributed_c10d._unregister_all_process_groups`
(abandon: dropping groups without waiting, which no public API does).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from oobleck_hpc.engine.tied import union
from oobleck_hpc.planning.plan import Plan
from oobleck_hpc.polling import wait_until

T = TypeVar("T")


class Waiter:
    """Runs blocking calls that cannot be interrupted (a gloo wait, a store connection) on
    one helper thread, reused call after call, while the caller polls a stop condition (module
    docstring, "gloo")."""

    def __init__(self, name: str):
        self.name = name
        self._inbox: queue.SimpleQueue | None = None

    def run(self, fn: Callable[[], T], stop: Callable[[], BaseException | None],
            poll_s: float) -> T:
        """`fn()` on the helper thread; raises what `stop()` returns as soon as it returns an
        exception (the call is then abandoned: it ends by itself at its own timeout, its result
        dropped, and the next `run` starts a fresh thread)."""
        if self._inbox is None:
            self._inbox = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._inbox,), daemon=True,
                             name=self.name).start()
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._inbox.put((fn, box, done))
        while not done.wait(poll_s):
            if (error := stop()) is not None:
                self._inbox.put(None)  # its thread leaves once the abandoned call returns
                self._inbox = None
                raise error
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.put(None)
            self._inbox = None


def _serve(inbox: queue.SimpleQueue) -> None:
    while (job := inbox.get()) is not None:
        fn, box, done = job
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))
        finally:
            done.set()


def run_abortable(fn: Callable[[], T], stop: Callable[[], BaseException | None], poll_s: float,
                  name: str) -> T:
    """A one-off `Waiter.run` (a store connection): its thread leaves when `fn` returns."""
    waiter = Waiter(name)
    try:
        return waiter.run(fn, stop, poll_s)
    finally:
        waiter.close()


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class Comm:
    """This process's membership in one generation of the training world."""

    rank: int
    world_size: int
    generation: int
    backend: str
    timeout_s: float
    device: torch.device | None = None
    """The rank's GPU (NCCL: communicators are bound to it); None on the CPU."""
    setup_timeout_s: float = 0.0
    """The regroup's long timeout (`init`'s `init_timeout_s`): creating the communicators, and
    the agreements of a start that may wait on one rank's disk (`all_reduce_max`)."""
    groups: list[dist.ProcessGroup] = field(default_factory=list, repr=False)
    """Every group of this generation: the world first, then the plan's subgroups."""
    _aborted: bool = field(default=False, repr=False)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"

    @classmethod
    def init(cls, store: dist.Store, rank: int, world_size: int, generation: int,
             backend: str = "gloo", timeout_s: float = 5.0, device: torch.device | None = None,
             init_timeout_s: float | None = None) -> Comm:
        """The generation's world. `init_timeout_s` (default `timeout_s`) bounds the creation of
        NCCL's communicators and a gloo world's waits after its connect; `timeout_s` that
        connect and every collective of the plan's groups (module docstring)."""
        if dist.is_initialized():
            raise RuntimeError("a process group is still initialised: call Comm.destroy() first")
        nccl = backend == "nccl"
        if nccl:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # CleanUpOnly
        prefixed = dist.PrefixStore(f"oobleck/gen{generation}/", store)
        t_init = datetime.timedelta(seconds=max(timeout_s, init_timeout_s or 0.0))
        # gloo connects the world's full mesh inside init_process_group and nothing can
        # interrupt it: the ranks have all arrived (recovery/generation.py, `regroup`), so it
        # gets the short connect timeout, as the subgroups do (`gloo_connect_timeout`); then
        # the long one for the world's collectives.
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=t_init if nccl else gloo_connect_timeout(timeout_s),
                                device_id=device if nccl else None)
        if not nccl:
            dist.group.WORLD.set_timeout(t_init)
        comm = cls(rank, world_size, generation, backend, timeout_s, device if nccl else None,
                   setup_timeout_s=t_init.total_seconds())
        comm.groups.append(dist.group.WORLD)
        return comm

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        timeout = self.timeout if self.nccl else gloo_connect_timeout(self.timeout_s)
        group = dist.new_group(ranks, timeout=timeout, backend=self.backend,
                               device_id=self.device)
        self.groups.append(group)
        return group

    def ready(self) -> None:
        """Every group is built: from now on the short collective timeout applies to all (to
        the plan's groups on gloo: its world keeps the long one, `init`)."""
        for g in self.groups if self.nccl else self.groups[1:]:
            if g not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                g.set_timeout(self.timeout)

    def destroy(self) -> None:
        """Tear down the default group and every subgroup created under it."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.groups.clear()

    def abort(self) -> None:
        """NCCL: abort every communicator of this generation -- its pending collectives fail at
        once instead of at the timeout, and its watchdog stops. Idempotent, safe from another
        thread and after `abandon`/`destroy`; nothing to do for gloo (see `abandon`)."""
        if not self.nccl or self._aborted:
            return
        self._aborted = True
        for g in list(self.groups):
            if g in (None, dist.GroupMember.NON_GROUP_MEMBER):
                continue
            try:
                g.abort()
            except Exception:  # noqa: BLE001 - already torn down: nothing left to abort
                pass

    def abandon(self) -> None:
        """Drop this generation's groups at once, even with collectives in flight (module
        docstring): NCCL communicators are aborted first; gloo groups are unregistered without
        a shutdown (`destroy()` would wait for pending work: up to the collective timeout, and
        a gloo wait cannot be aborted) and kept referenced in `_ABANDONED` so that no destructor
        blocks. The next generation's `init` then starts clean. Uses torch.distributed's
        private registry (module docstring)."""
        self.abort()
        if not dist.is_initialized():
            self.groups.clear()
            return
        c10d = dist.distributed_c10d
        world = c10d._world
        _ABANDONED.extend(world.pg_names.keys())
        c10d._update_default_pg(None)
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                      world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
            table.clear()
        c10d._unregister_all_process_groups()
        world.group_count = 0
        self.groups.clear()

    def wait(self, work: dist.Work | Sequence[dist.Work], waiter: Waiter,
             abort: Callable[[], bool] | None, sync: bool = False,
             timeout_s: float | None = None) -> None:
        """Wait for `work` (one, or several waited together: a transfer's messages), each
        bounded by `timeout_s` (default: the collective timeout), giving up as soon as
        `abort()` turns true (raising `Aborted`). NCCL: a stream dependency, the CPU runs on --
        unless `sync` (the result is read on the CPU next): then `is_completed()` is polled
        here. gloo: on the waiter's thread while this one polls `abort()` (module
        docstring)."""
        works = [work] if isinstance(work, dist.Work) else list(work)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.nccl:
            if not sync:
                for w in works:
                    w.wait()
                return

            def completed() -> bool:
                if all(w.is_completed() for w in works):
                    return True
                if abort is not None and abort():
                    raise Aborted("the elastic layer aborted the step (a membership round opened)")
                return False

            wait_until(completed, timeout_s, "a collective to complete", every_s=0.0005)
            for w in works:
                w.wait()  # completed: raises if it failed (NCCL has no is_success() any more)
            return
        timeout = datetime.timedelta(seconds=timeout_s)

        def wait_all() -> None:
            for w in works:
                w.wait(timeout)

        if abort is None:
            wait_all()
            return

        def stop() -> BaseException | None:
            if abort():
                return Aborted("the elastic layer aborted the step (a membership round opened)")
            return None

        waiter.run(wait_all, stop, 0.002)

    def all_reduce_max(self, values: list[float], abort: Callable[[], bool] | None = None,
                       timeout_s: float | None = None) -> list[float]:
        """Element-wise max of `values` over this generation's world, as `wait` bounds it. A
        start's agreement (the checkpoint to restore) passes the driver's `round_opened` and
        `setup_timeout_s`: a node lost meanwhile must not leave its peers waiting for that long
        timeout (a survivor that already left the failed start never joins the call)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        waiter = Waiter("all-reduce-max")
        try:
            self.wait(work, waiter, abort, sync=True, timeout_s=timeout_s)
        finally:
            waiter.close()
        return t.cpu().tolist()


GLOO_CONNECT_ATTEMPTS = 5
"""gloo's full-mesh connect waits up to this many times its group's timeout for a peer that
published its address and never connected, when gloo picked that peer to connect (it compares
the two addresses; measured, torch 2.13: a peer stopped or killed just after publishing held
the others 10.0 s with a 2 s timeout). A peer that never published is waited for the timeout
itself; one stopped after publishing, whom the waiting rank connects to, not at all (the
kernel accepts): its first collective waits instead, as any hang's does."""
CONNECT_FLOOR_S = 1.0
"""The least time a gloo group's members get to publish their addresses (below)."""


def gloo_connect_timeout(timeout_s: float) -> datetime.timedelta:
    """The timeout a gloo group is created with, so that its connect is bounded by the
    collective timeout `timeout_s` (or by GLOO_CONNECT_ATTEMPTS x CONNECT_FLOOR_S, if that is
    longer), not GLOO_CONNECT_ATTEMPTS times it (chaos seed 5204, trial 19: a node lost while
    its peers built a recovery's subgroups held them 25 s in the connect, with a 5 s collective
    timeout). The store wait for the members' addresses gets the same timeout: all ranks have
    reached the store before (recovery/rendezvous.py, `wait_arrivals`) and build the same
    groups in the same order, so a member is late by a group's connect at most. `Comm.init`
    and `ready` then set the collective timeouts."""
    return datetime.timedelta(seconds=max(CONNECT_FLOOR_S, timeout_s / GLOO_CONNECT_ATTEMPTS))


class Aborted(RuntimeError):
    """The `abort` callback asked a wait to stop (the step is returned as failed)."""


_ABANDONED: list[dist.ProcessGroup] = []
"""Groups dropped by `Comm.abandon` (kept alive on purpose: see there)."""


@dataclass
class PlanGroups:
    """The groups of one plan, keyed by rank set. `group(ranks)` is None for a single rank."""

    groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @staticmethod
    def rank_sets(plan: Plan, tied: Collection[tuple[int, int]] = ()) -> list[tuple[int, ...]]:
        """Distinct holder sets of >= 2 ranks over all layers, and the holders of either layer
        of each pair in `tied` (layers sharing a tensor: engine/tied.py), sorted (creation
        order)."""
        sets = {plan.layer_owners(layer) for layer in range(plan.num_layers)}
        sets |= {union(plan, i, j) for i, j in tied}
        return sorted(s for s in sets if len(s) > 1)

    @classmethod
    def build(cls, plan: Plan, comm: Comm, tied: Collection[tuple[int, int]] = ()) -> PlanGroups:
        """Every group of `plan` in `comm`; `tied`: the model's `tied_layers` (every rank of
        the world passes the same)."""
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan has {plan.world_size} ranks but the world has {comm.world_size}")
        out = cls()
        for ranks in cls.rank_sets(plan, tied):
            if len(ranks) == comm.world_size:
                out.groups[ranks] = dist.group.WORLD
            else:
                group = comm.new_group(list(ranks))
                if comm.rank in ranks:
                    out.groups[ranks] = group
        comm.ready()
        return out

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self.groups.get(tuple(ranks))
