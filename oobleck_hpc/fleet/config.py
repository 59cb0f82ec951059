"""The fleet file (`fleet.yaml`) as typed dataclasses, loaded as strictly as a job file.

    pool:
      nodes: 8                  # the nodes the fleet shares (local, or one Slurm allocation)
    mtbf_hours: 3.0             # the pool's mean time between failures (optional)
    slurm:                      # the allocation of `fleet submit` (optional; a job file's
      time_min: 600             #   slurm keys: partition, account, time_min, setup, extra...)
    jobs:
      - job: gpt-tiny-local.yaml    # an ordinary job file, relative to this file's folder
        weight: 4                   # priority: the job's FLOP/s count this many times
        min_nodes: 2                # below this the job waits (optional, default 1)
        max_nodes: 6                # optional
        transition_s: 60            # its pause when its node count changes (optional)

An unknown key is answered with the valid ones, a bad value with the file, the key, the value
and the fix (schema.py, as config.py); each job file is then loaded and validated as
`oobleck-hpc run` would (its own errors name its own file). Its `cluster.nodes` is not used:
the fleet decides how many nodes it gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


from oobleck_hpc.config import JobConfig, load_job
from oobleck_hpc.configs.cluster import SlurmConfig
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.schema import Where, build, read_mapping, walk

TRANSITION_S = 60.0
"""Default seconds a job pauses when its node count changes. Our own recovery and join take
seconds locally (detection by lease 3 s, regrouping 0.1-2 s, the layers copied to a joining
node); on thousands of GPUs NCCL communicators take seconds to rebuild and a joining node
receives tens of GB of layer state. A minute is a deliberately cautious guess until the fleet
measures each job's own from its events (issue 32)."""
MTBF_HOURS = 3.0
"""Default mean time between failures of the pool: Llama 3 405B's training saw 419 unexpected
interruptions in 54 days on 16,384 GPUs, one every 3.1 hours (Dubey et al. 2024, section 3.3.4).
For a smaller pool it is pessimistic, so fewer moves pay: set the pool's own."""


@dataclass
class PoolConfig:
    nodes: int
    """Nodes the fleet shares (`fleet plan --nodes N` overrides it)."""

    def check(self, where: Where) -> None:
        if self.nodes < 1:
            where.fail("nodes", self.nodes, "must be at least 1", "give the pool's node count")


@dataclass
class FleetJobConfig:
    job: str
    """An ordinary job file, relative to the fleet file's folder (or absolute)."""
    weight: float = 1.0
    """Priority: WAF = weight x the job's achieved FLOP/s."""
    name: str | None = None
    """The job's name in the fleet (default: the job file's `name`)."""
    min_nodes: int = 1
    """Fewer nodes than this and the job waits (it gets none); the planner's own minimum
    ((f+1) x n0) applies as well."""
    max_nodes: int | None = None
    """Never more nodes than this (default: as many as pay)."""
    transition_s: float = TRANSITION_S
    """Seconds the job pauses when its node count changes (recovery after a drain, join
    after a grow); the decision charges it x the job's WAF for every move."""

    def check(self, where: Where) -> None:
        if not self.weight > 0:
            where.fail("weight", self.weight, "must be > 0",
                       "give the job's priority as a positive number (e.g. 1, 2, 4)")
        if self.min_nodes < 1:
            where.fail("min_nodes", self.min_nodes, "must be at least 1",
                       "give the fewest nodes the job may run on (or leave it out)")
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            where.fail("max_nodes", self.max_nodes, f"is below min_nodes ({self.min_nodes})",
                       f"give at least {self.min_nodes}, or leave it out")
        if self.transition_s < 0:
            where.fail("transition_s", self.transition_s, "must be >= 0",
                       f"give the job's pause in seconds (default {TRANSITION_S:g})")


@dataclass
class FleetConfig:
    pool: PoolConfig
    jobs: list[FleetJobConfig]
    name: str = "fleet"
    mtbf_hours: float = MTBF_HOURS
    """The pool's mean time between failures: the horizon over which a move must pay."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The allocation `fleet submit` asks for (pool.nodes nodes); each job's own `slurm:`
    keys still say how its steps run (mpi, agent_command)."""
    source: str = field(default="<python>", compare=False, repr=False)
    """The file this fleet was read from (for messages and relative job paths); not a key."""

    def check(self, where: Where) -> None:
        if not self.jobs:
            where.fail("jobs", self.jobs, "is empty", "list at least one job ('- job: FILE')")
        if not self.mtbf_hours > 0:
            where.fail("mtbf_hours", self.mtbf_hours, "must be > 0",
                       "give the pool's mean time between failures in hours")

    def job_path(self, entry: FleetJobConfig) -> Path:
        return Path(self.source).parent / entry.job


@dataclass(frozen=True)
class FleetJob:
    """One job of a loaded fleet: its entry and its job file, read."""

    name: str
    entry: FleetJobConfig
    job: JobConfig


def fleet_from_dict(data: dict, source: str = "<dict>") -> FleetConfig:
    fleet = build(FleetConfig, data, Where(source, ""))
    fleet.source = source
    walk(fleet, Where(source, ""))
    return fleet


def load_fleet(path: str | Path, nodes: int | None = None) -> tuple[FleetConfig, list[FleetJob]]:
    """Read and validate a fleet file and every job file it names. `nodes` replaces
    pool.nodes."""
    path = Path(path)
    data = read_mapping(path, "fleet file")
    if nodes is not None:
        pool = data.get("pool")
        data["pool"] = {**(pool if isinstance(pool, dict) else {}), "nodes": nodes}
    fleet = fleet_from_dict(data, str(path))
    jobs: list[FleetJob] = []
    for i, entry in enumerate(fleet.jobs):
        job_file = fleet.job_path(entry)
        if not job_file.is_file():
            raise ConfigError(str(path), f"jobs[{i}].job", f"value {entry.job!r} is not a file "
                              f"({job_file} does not exist)",
                              f"give a job file's path relative to {path.parent}/")
        job = load_job(job_file)
        name = entry.name or job.name
        if name in [j.name for j in jobs]:
            raise ConfigError(str(path), f"jobs[{i}]", f"names the job {name!r} twice",
                              "give each entry its own 'name:'")
        jobs.append(FleetJob(name, entry, job))
    return fleet, jobs
