"""The YAML job file as typed dataclasses: the one place code and users import them from.

One dataclass per concern; every field is documented, and its default declared, where it is
declared: the sections in oobleck_hpc/configs/ (`training`: model, data, train; `cluster`:
cluster, slurm, profile; `resilience`: fault_tolerance, checkpoint, faults and the control
plane's defaults), `JobConfig`, which holds them, and the loader here. Loading is strict:
an unknown key is answered with the list of valid keys, a value of the wrong type or out of range
with the file, the key, the value and the fix -- before any process is started or node allocated.

    job = load_job("examples/gpt-tiny-local.yaml")
    job.cluster.nodes, job.train.global_microbatches, ...

A job can also be built in Python (`JobConfig(model=ModelConfig(name="gpt-tiny"), ...)`) and
checked with `job.validate()`. The strict loading itself (types, unknown keys) is schema.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from oobleck_hpc.configs.cluster import ClusterConfig, ProfileConfig, SlurmConfig
from oobleck_hpc.configs.resilience import (FENCED_GRACE_S, HEARTBEAT_S, LEASE_S, STALL_FLOOR_S,
                                            STALL_MULTIPLE, STALL_PROBE_S, STALL_STEPS,
                                            STARTUP_S, CheckpointConfig, FaultConfig, FaultToleranceConfig)
from oobleck_hpc.configs.training import DataConfig, ModelConfig, TrainConfig
from oobleck_hpc.schema import read_mapping
from oobleck_hpc.schema import Where as _Where
from oobleck_hpc.schema import build as _build
from oobleck_hpc.schema import walk as _walk

__all__ = ["CheckpointConfig", "ClusterConfig", "DataConfig", "FaultConfig", "FaultToleranceConfig",
           "JobConfig", "ModelConfig", "ProfileConfig", "SlurmConfig", "TrainConfig",
           "FENCED_GRACE_S", "HEARTBEAT_S", "LEASE_S", "STALL_FLOOR_S", "STALL_MULTIPLE",
           "STALL_PROBE_S", "STALL_STEPS", "STARTUP_S", "job_from_dict", "load_job"]


@dataclass
class JobConfig:
    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    faults: list[FaultConfig] = field(default_factory=list)
    """Injected failures, for tests and demos."""
    run_dir: str | None = None
    """Where events, metrics and logs go; default runs/<name>."""
    group_access: bool = False
    """The run's files (RUN_DIR, checkpoints, logs) are the user's alone (0700 / 0600); true (a
    team's run): its group may read them too (0750 / 0640), not RUN_DIR/secret (records/runs.py)."""
    source: str = field(default="<python>", compare=False, repr=False)
    """The file this job was read from (for error messages); not a YAML key."""

    def check(self, where: _Where) -> None:
        if self.fault_tolerance.replace and self.cluster.launch != "slurm":
            where.fail("fault_tolerance.replace", True, "needs cluster.launch: slurm (it submits "
                       "replacement jobs)", "set it to false; grow a local job by hand with "
                       "`oobleck-hpc grow RUN_DIR --nodes K`")
        for i, fault in enumerate(self.faults):
            if fault.kind == "grow" and self.cluster.launch != "local":
                where.fail(f"faults[{i}].kind", "grow", "needs cluster.launch: local (the local "
                           "launcher starts the node)", "under Slurm grow with "
                           "fault_tolerance.replace or `oobleck-hpc grow JOB_ID --nodes K`")
            if not 0 <= fault.node < self.cluster.nodes:
                where.fail(f"faults[{i}].node", fault.node,
                           f"is not a node of this job (cluster.nodes={self.cluster.nodes})",
                           f"use an index in 0..{self.cluster.nodes - 1}")
            if not 1 <= fault.step <= self.train.steps:
                where.fail(f"faults[{i}].step", fault.step,
                           f"is not a step of this job (train.steps={self.train.steps}; steps "
                           "are numbered from 1)", f"use a step in 1..{self.train.steps}")

    def validate(self) -> JobConfig:
        _walk(self, _Where(self.source, ""))
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out


# ----------------------------------------------------------------------------- loading


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Read and validate a YAML job file. `overrides` maps dotted keys to values
    (e.g. {"cluster.nodes": 8}) and is applied before validation."""
    path = Path(path)
    data = read_mapping(path, "YAML job file")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return job_from_dict(data, source=str(path))


def job_from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    job = _build(JobConfig, data, _Where(source, ""))
    job.source = source
    return job.validate()
