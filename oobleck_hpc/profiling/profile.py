"""Profile data model: what the planner knows about a model on a machine. Pure data, no I/O.

A profile is measured (oobleck_hpc.profiling.profiler) or analytic (oobleck_hpc.profiling.analytic)
and stored as HDF5 (oobleck_hpc.profiling.store, the only module that imports h5py).

Units: times in milliseconds, sizes in bytes, bandwidth in bytes per second.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 3
"""Schema history: 1 = per-layer times at the full microbatch only; 2 adds per-layer
`optimizer_ms` and the compute times at every row count 1..microbatch_size
(`forward_rows_ms`, `backward_rows_ms`); 3 adds the machine's `core_sharing` table. The store
still reads schema 1 and 2 files (those fields empty / zero) and writes schema 3."""
READ_SCHEMAS = (1, 2, 3)


@dataclass(frozen=True)
class LayerProfile:
    """One layer (the unit the planner partitions), for one microbatch on one device."""

    name: str
    forward_ms: float
    backward_ms: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Bytes kept for backward per microbatch in flight."""
    output_bytes: int
    """Bytes of the output activation sent to the next layer per microbatch (the gradient sent
    back has the same size)."""
    forward_spread_ms: float = 0.0
    """Spread (interquartile range) of the repeated measurement; 0 for analytic profiles."""
    backward_spread_ms: float = 0.0
    optimizer_ms: float = 0.0
    """One optimizer step (the engine's AdamW) over this layer's parameters; 0 when not measured
    (analytic profiles, schema 1 files)."""
    forward_rows_ms: tuple[float, ...] = ()
    """Forward time at microbatch rows 1, 2, .., microbatch_size (the last equals forward_ms):
    what a k-GPU stage, which gives each GPU ceil(rows / k) of them, really runs. Empty when not
    measured (planning/cost.py says what the planner assumes then)."""
    backward_rows_ms: tuple[float, ...] = ()
    """Backward time at rows 1, 2, .., microbatch_size, like forward_rows_ms."""

    @property
    def state_bytes(self) -> int:
        """Per-layer state a replica must hold (and a reconfiguration must copy)."""
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta model of one kind of communication: latency + bytes / bandwidth."""

    latency_ms: float
    bandwidth: float
    """Bytes per second."""

    def time_ms(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_ms + 1000.0 * nbytes / self.bandwidth


@dataclass(frozen=True)
class MachineProfile:
    """The machine the profile was measured on (or describes)."""

    device_name: str
    device_memory_bytes: int
    gpus_per_node: int
    p2p_intra: LinkCost
    """Point-to-point inside one node (NVLink; on CPU: shared memory / loopback)."""
    p2p_inter: LinkCost
    """Point-to-point across nodes (InfiniBand; on one machine: loopback, labelled so)."""
    allreduce_intra: LinkCost
    """Ring all-reduce step cost inside a node; see planning/cost.py for how it is used."""
    allreduce_inter: LinkCost
    interconnect: str = "unknown"
    core_sharing: tuple[float, ...] = ()
    """CPU only: entry k-1 is how many times longer one worker's forward + backward of the whole
    model takes when k workers per core run it at once on every core of the host (entry 0, one
    per core, is ~1). It is k when time-sharing is free; it was measured above k (context
    switches, caches). Empty for GPUs and for profiles that did not measure it; how the planner
    uses it: planning/cost.py, host_slowdown."""


@dataclass(frozen=True)
class Fingerprint:
    """What a profile is of. The job's own fingerprint must match before the planner uses it."""

    model_name: str
    arch_hash: str
    microbatch_size: int
    dtype: str
    device_name: str
    gpus_per_node: int
    interconnect: str
    source: str = "measured"
    """'measured' or 'analytic'."""
    torch_version: str = ""
    cuda_version: str = ""
    nccl_version: str = ""
    schema_version: int = SCHEMA_VERSION
    tool_version: str = ""
    created_at: str = ""
    """ISO-8601 UTC."""


@dataclass(frozen=True)
class ModelProfile:
    fingerprint: Fingerprint
    machine: MachineProfile
    layers: tuple[LayerProfile, ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def digest(self) -> str:
        """A stable hash of everything the planner reads: plans computed by different processes
        from profiles with equal digests are byte-identical."""
        payload = json.dumps({"machine": asdict(self.machine),
                              "layers": [asdict(x) for x in self.layers]},
                             sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
