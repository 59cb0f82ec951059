"""The job file's sections about where the job runs: `cluster` (local processes or Slurm, nodes,
GPUs), `slurm` (the batch job's parameters) and `profile` (the measured profile of the model on
those machines, which the planner reads).

Part of the job file's dataclasses (config.py imports them from here; import them from
`oobleck_hpc.config`). Every default is the field's own, declared once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from oobleck_hpc.schema import Where as _Where


@dataclass
class ClusterConfig:
    launch: Literal["local", "slurm"] = "local"
    """'local': node agents are processes on this machine (the embedded default);
    'slurm': one agent per allocated node, started by srun (see `oobleck-hpc submit`)."""
    nodes: int = 4
    """Nodes to start with (under Slurm: nodes to allocate)."""
    gpus_per_node: int = 2
    """Worker processes per node: one per GPU (on CPU: one per pretend GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks cuda when GPUs are visible, else cpu."""
    spares: int = 0
    """Extra nodes that start idle (workers ready, no layers) and are swapped in by the round
    of a loss, so the job goes on at full size (control/membership.py, step 7). Under Slurm
    the job allocates nodes + spares; the last ones of the allocation are the spares."""
    kill_grace_s: float = 20.0
    """Local launcher: how long the nodes still running get to exit once the run finished (its
    last step committed) or after a forwarded stop signal; a node that leaves early never."""

    def check(self, where: _Where) -> None:
        if self.nodes < 1:
            where.fail("nodes", self.nodes, "must be at least 1", "use a positive integer")
        if self.spares < 0:
            where.fail("spares", self.spares, "must be >= 0", "use the number of idle spare nodes")
        if self.gpus_per_node < 1:
            where.fail("gpus_per_node", self.gpus_per_node, "must be at least 1",
                       "use the number of GPUs of one node (CPU runs: worker processes per node)")
        if self.kill_grace_s <= 0:
            where.fail("kill_grace_s", self.kill_grace_s, "must be > 0",
                       "use the seconds the last nodes get to exit (default 20)")


@dataclass
class ProfileConfig:
    library: str = "profiles"
    """Directory of the HDF5 profile library (profiles/<model>/<device>/<dtype>-mb<k>.h5)."""
    path: str | None = None
    """An explicit profile file; overrides the library lookup."""
    device: str | None = None
    """Device name in the library (e.g. 'cpu', 'A100-80G'); defaults to the job's device."""
    analytic: bool = False
    """Use an analytic profile (FLOP and byte counts) when no measured one is in the library."""


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    time_min: int = 60
    """Wall-time limit in minutes (sbatch --time)."""
    gpus_per_node: int | None = None
    """GPUs to request per node (--gpus-per-node); none on CPU clusters."""
    signal_delay_s: int = 90
    """The pre-timeout signal arrives this long before the time limit (checkpoint + requeue)."""
    signal: str = "USR2"
    """The pre-timeout signal sent to every agent (sbatch --signal=SIGNAL@signal_delay_s)."""
    mpi: str = "pmix"
    """srun --mpi plugin of the discovery step: 'pmix' for Open MPI (the default wheel),
    'pmi2' for MPICH builds; must be listed by `srun --mpi=list` on the cluster."""
    agent_command: str | None = None
    """The per-node command; placeholders {python} {job} {run_dir} {roster}. Default:
    '{python} -m oobleck_hpc.control.agent --job {job} --run-dir {run_dir}'."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before anything else (module load, conda activate)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Further sbatch flags, e.g. {qos: high, constraint: a100}."""

    def check(self, where: _Where) -> None:
        if self.time_min < 1:
            where.fail("time_min", self.time_min, "must be at least 1", "give the limit in minutes")
        if self.signal_delay_s < 0 or self.signal_delay_s >= 60 * self.time_min:
            where.fail("signal_delay_s", self.signal_delay_s,
                       f"must lie in [0, time_min*60={60 * self.time_min})",
                       "leave enough time for a checkpoint, e.g. 90")
        name = self.signal.upper().removeprefix("SIG")
        if name not in _SIGNALS:
            where.fail("signal", self.signal, "is not a signal name", "use e.g. USR2 or TERM")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            where.fail("gpus_per_node", self.gpus_per_node, "must be >= 0", "use the GPUs of one node")
        if self.agent_command is not None:
            try:
                self.agent_command.format(python="python", job="j.yaml", run_dir="runs/x",
                                          roster="runs/x/roster.json")
            except (KeyError, IndexError, ValueError) as e:
                where.fail("agent_command", self.agent_command, f"has a bad placeholder ({e})",
                           "use only {python}, {job}, {run_dir} and {roster}")
        for key in self.extra:
            if key.replace("_", "-") in _MANAGED_SBATCH_FLAGS:
                where.fail(f"extra.{key}", self.extra[key], "is set by oobleck_hpc itself",
                           f"remove it (managed flags: {', '.join(sorted(_MANAGED_SBATCH_FLAGS))})")


_SIGNALS = {"HUP", "INT", "QUIT", "USR1", "USR2", "TERM", "CONT", "URG", "WINCH", "ALRM"}
_MANAGED_SBATCH_FLAGS = {"nodes", "no-kill", "requeue", "signal", "time", "job-name", "output",
                         "error", "ntasks-per-node"}
