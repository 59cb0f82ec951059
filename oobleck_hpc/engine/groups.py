"""Process groups: one world per generation, and the plan's groups, deduplicated by rank set.

Lifecycle (the elastic layer relies on exactly this):

    comm = Comm.init(store, rank, world_size, generation, backend, timeout_s)   # default group
    groups = PlanGroups.build(plan, comm)     # every distinct rank set of >= 2 ranks, once
    ... train ...
    comm.destroy()                            # destroys the default group AND every subgroup

`init` wraps the caller's store in a `PrefixStore("oobleck/gen<generation>/")`, so a rebuilt
world never reads keys left by an older one (torchft does the same). After `destroy` nothing of
the old groups is left in torch.distributed; the same processes can `init` a new generation
with a different world size and rank. The collective timeout is short (the job's
`fault_tolerance.collective_timeout_s`): it bounds how long a hung peer can stall anything.

Which groups a plan needs: the sets of ranks that hold the same layers (`plan.layer_owners`).
A layer's holders are all replicas of its stage in every pipeline (in-node GPUs of a multi-GPU
stage included), so ONE all-reduce over that set sums both the in-node data-parallel shares and
the pipelines' contributions. Layers with identical holder sets share a group and a flat buffer.
Point-to-point traffic uses the default group. Every rank creates every group, in the same
(sorted) order, as `new_group` requires.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist

from oobleck_hpc.planning.plan import Plan


T = TypeVar("T")


def run_abortable(fn: Callable[[], T], stop: Callable[[], BaseException | None], poll_s: float,
                  name: str) -> T:
    """`fn()` -- a blocking torch.distributed call that cannot be interrupted (a gloo wait, a
    TCPStore connection) -- on a helper thread; this thread polls `stop()` every `poll_s` and
    raises what it returns as soon as it returns an exception. The abandoned call ends by itself
    at its own timeout; its result is dropped."""
    done = threading.Event()
    result: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=name).start()
    while not done.wait(poll_s):
        if (error := stop()) is not None:
            raise error
    ok, value = result[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


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

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @classmethod
    def init(cls, store: dist.Store, rank: int, world_size: int, generation: int,
             backend: str = "gloo", timeout_s: float = 5.0) -> Comm:
        if dist.is_initialized():
            raise RuntimeError("a process group is still initialised: call Comm.destroy() first")
        prefixed = dist.PrefixStore(f"oobleck/gen{generation}/", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world_size, generation, backend, timeout_s)

    def destroy(self) -> None:
        """Tear down the default group and every subgroup created under it."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def abandon(self) -> None:
        """Drop this generation's groups at once, even with collectives in flight.

        `destroy()` waits for pending work (gloo: up to the collective timeout; measured here:
        9 s left of a 10 s timeout), and a gloo wait cannot be aborted. After a failure the
        elastic layer instead unregisters every group from torch.distributed (as destroy does)
        WITHOUT shutting them down, and keeps the objects referenced in `_ABANDONED` so that no
        destructor blocks either: their pending work fails at its own timeout, in the
        background, and nobody waits for it. The next generation's `init` then starts clean.
        Uses torch.distributed's private registry (`distributed_c10d._world`)."""
        if not dist.is_initialized():
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


_ABANDONED: list[dist.ProcessGroup] = []
"""Groups dropped by `Comm.abandon` (kept alive on purpose: see there)."""


@dataclass
class PlanGroups:
    """The groups of one plan, keyed by rank set. `group(ranks)` is None for a single rank."""

    groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @staticmethod
    def rank_sets(plan: Plan) -> list[tuple[int, ...]]:
        """Distinct holder sets of >= 2 ranks over all layers, sorted (creation order)."""
        sets = {plan.layer_owners(layer) for layer in range(plan.num_layers)}
        return sorted(s for s in sets if len(s) > 1)

    @classmethod
    def build(cls, plan: Plan, comm: Comm) -> PlanGroups:
        if plan.world_size != comm.world_size:
            raise ValueError(f"plan has {plan.world_size} ranks but the world has {comm.world_size}")
        out = cls()
        for ranks in cls.rank_sets(plan):
            if len(ranks) == comm.world_size:
                out.groups[ranks] = dist.group.WORLD
            else:
                group = dist.new_group(list(ranks), timeout=comm.timeout, backend=comm.backend)
                if comm.rank in ranks:
                    out.groups[ranks] = group
        return out

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self.groups.get(tuple(ranks))
