"""Who am I: one small `NodeEnvironment`, filled by one `detect()` per source.

Sources, tried in this order by `detect()`:

1. `LocalEnvironment` -- the OOBLECK_* variables a launcher of ours sets (the local launcher for
   its pretend nodes, and a node agent for its worker processes). They are the most specific
   description of a process, so they win over Slurm's variables that a worker also inherits.
2. `SlurmEnvironment` -- a task started by `srun` (SLURM_JOB_ID and SLURMD_NODENAME are set).

Slurm caveat (measured on Slurm 22.05): after a node of a `--no-kill` job dies, SLURM_JOB_NODELIST
and SLURM_JOB_NUM_NODES stay stale in every process; only the controller knows the current node
set (`scontrol show job $SLURM_JOB_ID`, NodeList=). `detect()` reads the environment only (no
RPC, so a thousand tasks starting at once do not flood the controller); `current_job_nodes()`
asks the controller and is called by one process at a time (the discovery's rank 0, the driver).

Nothing here imports torch or MPI: the device count is read from CUDA_VISIBLE_DEVICES or the
/dev/nvidiaN device files.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# The variables of the local-launcher source (written by `NodeEnvironment.to_env`).
ENV_PREFIX = "OOBLECK_"
ENV_NODE_ADDR = "OOBLECK_NODE_ADDR"  # also honoured under Slurm: the address peers should use


@dataclass
class NodeEnvironment:
    """What a process knows about its place in the job, before any rendezvous."""

    source: str
    """'local' or 'slurm': which detector filled this."""
    job_id: str
    """Slurm job id, or the local launcher's run id."""
    node: str
    """This node's name (SLURMD_NODENAME under Slurm: right even with several slurmd per host)."""
    nodes: list[str]
    """The job's nodes in launch order, as known at start (under Slurm: may be stale after a
    node loss; see `current_job_nodes`)."""
    task_rank: int = 0
    """Global index of this task in its launch step (SLURM_PROCID)."""
    local_rank: int = 0
    """Index of this task on its node (SLURM_LOCALID; a worker's GPU index)."""
    num_tasks: int = 1
    """Tasks in the launch step (SLURM_NTASKS)."""
    restart_count: int = 0
    """How often Slurm requeued this job (SLURM_RESTART_COUNT); 0 on the first run."""
    step_id: str | None = None
    """SLURM_STEP_ID of the task, when started by srun."""
    address: str = "127.0.0.1"
    """The address peers reach this node at ($OOBLECK_NODE_ADDR, else the host name's address)."""
    device_count: int = 0
    """GPUs visible to this process (0 on CPU machines)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Further OOBLECK_* variables of the local launcher (e.g. OOBLECK_RUN_DIR), unparsed."""

    @property
    def node_rank(self) -> int:
        """Index of this node in `nodes`."""
        return self.nodes.index(self.node)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def to_env(self) -> dict[str, str]:
        """The OOBLECK_* variables that make `detect()` in a child process return this object
        (source 'local'); a launcher or agent passes them to the processes it starts."""
        env = {f"{ENV_PREFIX}{k.upper()}": v for k, v in self.extra.items()}
        env.update({
            "OOBLECK_JOB_ID": self.job_id,
            "OOBLECK_NODE": self.node,
            "OOBLECK_NODES": ",".join(self.nodes),
            "OOBLECK_TASK_RANK": str(self.task_rank),
            "OOBLECK_LOCAL_RANK": str(self.local_rank),
            "OOBLECK_NUM_TASKS": str(self.num_tasks),
            "OOBLECK_RESTART_COUNT": str(self.restart_count),
            ENV_NODE_ADDR: self.address,
            "OOBLECK_DEVICE_COUNT": str(self.device_count),
        })
        return env

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LocalEnvironment:
    """Processes started by an oobleck_hpc launcher or agent (OOBLECK_NODE is set)."""

    _KNOWN = {"JOB_ID", "NODE", "NODES", "TASK_RANK", "LOCAL_RANK", "NUM_TASKS", "RESTART_COUNT",
              "NODE_ADDR", "DEVICE_COUNT"}

    @staticmethod
    def detect(env: dict[str, str] | None = None) -> NodeEnvironment | None:
        env = os.environ if env is None else env
        if "OOBLECK_NODE" not in env:
            return None
        node = env["OOBLECK_NODE"]
        nodes = [n for n in env.get("OOBLECK_NODES", node).split(",") if n]
        if node not in nodes:
            raise RuntimeError(f"OOBLECK_NODE={node!r} is not in OOBLECK_NODES={nodes}; "
                               "the launcher set an inconsistent environment")
        extra = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items()
                 if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):] not in LocalEnvironment._KNOWN}
        return NodeEnvironment(
            source="local",
            job_id=env.get("OOBLECK_JOB_ID", "local"),
            node=node,
            nodes=nodes,
            task_rank=int(env.get("OOBLECK_TASK_RANK", "0")),
            local_rank=int(env.get("OOBLECK_LOCAL_RANK", "0")),
            num_tasks=int(env.get("OOBLECK_NUM_TASKS", "1")),
            restart_count=int(env.get("OOBLECK_RESTART_COUNT", "0")),
            address=env.get(ENV_NODE_ADDR) or "127.0.0.1",
            device_count=int(env.get("OOBLECK_DEVICE_COUNT", "0")),
            extra=extra,
        )


class SlurmEnvironment:
    """A task of a Slurm job step (started by srun; the batch script itself also qualifies)."""

    @staticmethod
    def detect(env: dict[str, str] | None = None) -> NodeEnvironment | None:
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env:
            return None
        node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        # Inside a step, the step's node list is the set the step really runs on; the job's list
        # may be stale after a node loss (see module docstring).
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or node
        nodes = expand_hostlist(nodelist)
        return NodeEnvironment(
            source="slurm",
            job_id=env["SLURM_JOB_ID"],
            node=node,
            nodes=nodes,
            task_rank=int(env.get("SLURM_PROCID", "0")),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            num_tasks=int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"),
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
            step_id=env.get("SLURM_STEP_ID"),
            address=node_address(env),
            device_count=visible_device_count(env),
        )


DETECTORS = (LocalEnvironment, SlurmEnvironment)


def detect(env: dict[str, str] | None = None) -> NodeEnvironment:
    """The environment of this process: the first detector that recognises it, else a single
    local node (a plain `python` run on a workstation)."""
    for detector in DETECTORS:
        found = detector.detect(env)
        if found is not None:
            return found
    env = os.environ if env is None else env
    node = socket.gethostname().split(".")[0]
    return NodeEnvironment(source="local", job_id="local", node=node, nodes=[node],
                           address=env.get(ENV_NODE_ADDR) or "127.0.0.1",
                           device_count=visible_device_count(env))


# ----------------------------------------------------------------------------- helpers


def expand_hostlist(hostlist: str) -> list[str]:
    """'n[1-3],gpu7' -> ['n1', 'n2', 'n3', 'gpu7'], by `scontrol show hostnames` (parsed locally
    by scontrol, no controller RPC), with a small parser as fallback where scontrol is absent."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    # scontrol prints nothing for forms it does not parse (e.g. a suffix after the brackets)
    return out.split() or _expand_hostlist_py(hostlist)


def _expand_hostlist_py(hostlist: str) -> list[str]:
    names: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", hostlist):
        if not prefix and not ranges:
            continue
        if not ranges:
            names.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return names


def current_job_nodes(job_id: str) -> list[str]:
    """The job's nodes now, from the controller (`scontrol show job`): after a node loss this
    differs from SLURM_JOB_NODELIST, which stays stale. One RPC: call it from one process."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    match = re.search(r"(?:^|\s)NodeList=(\S+)", out)
    if match is None or match.group(1) == "(null)":
        return []
    return expand_hostlist(match.group(1))


def node_address(env: dict[str, str] | None = None) -> str:
    """$OOBLECK_NODE_ADDR, else the address of this host's name, else 127.0.0.1."""
    env = os.environ if env is None else env
    if env.get(ENV_NODE_ADDR):
        return env[ENV_NODE_ADDR]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def visible_device_count(env: dict[str, str] | None = None) -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set (Slurm sets it for --gpus
    allocations), else the number of /dev/nvidiaN device files. No CUDA initialisation."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "NoDevFiles"])
    return len([p for p in Path("/dev").glob("nvidia[0-9]*")])

