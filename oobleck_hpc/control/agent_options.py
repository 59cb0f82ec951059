"""The per-node agent's options and command line (oobleck_hpc/control/agent.py runs them):

    python -m oobleck_hpc.control.agent --node NAME --roster FILE -- WORKER COMMAND...
    python -m oobleck_hpc.control.agent --job JOB --run-dir RUN_DIR        # under Slurm

`parse_args` reads the flags (and the job file's fault_tolerance, gpus_per_node and run_dir)
into `AgentOptions`; control/agent.py's module docstring says what the agent does with them.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from oobleck_hpc.config import FENCED_GRACE_S, HEARTBEAT_S, LEASE_S, STARTUP_S, load_job
from oobleck_hpc.control.wire import Roster, join_roster_file

DESCRIPTION = ("The per-node agent: `python -m oobleck_hpc.control.agent --node NAME --roster FILE -- "
               "WORKER COMMAND...`")


@dataclass
class AgentOptions:
    node: str
    roster: Roster
    command: list[str]
    workers: int = 1
    run_dir: Path = Path("runs/job")
    heartbeat_s: float = HEARTBEAT_S
    lease_s: float = LEASE_S
    probe_s: float | None = None
    agreement_timeout_s: float | None = None
    startup_s: float = STARTUP_S
    quorum: str = "majority"
    kill_grace_s: float = FENCED_GRACE_S
    drain_poll_s: float = 0.0
    """How often to ask slurmctld whether this node is set to DRAIN (0: never; control/drain.py)."""
    job: Path | None = None
    """The job file, passed to the workers as OOBLECK_JOB."""
    boost_start: bool = False
    """The node starts while the job trains, on cores it shares with the members (the local
    launcher's grown nodes: launch/local_agents.py): its workers start at a higher CPU priority
    until they train (workers.py, `START_NICE`). It asks to join once they are ready, as every
    node does, so the members never idle through its start -- and without the boost its
    workers, a small share of the cores among the members', took 25-35 s to import torch and
    plan with 8-10 workers training on 2 cores (issue 27). A node with cores of its own needs
    none."""
    extra_env: dict[str, str] = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oobleck_hpc.control.agent", description=DESCRIPTION)
    p.add_argument("--node", help="this node's name in the roster (default: $SLURMD_NODENAME, "
                   "else the short host name)")
    p.add_argument("--roster", help="roster JSON file (see oobleck_hpc/control/wire.py; default: "
                   "RUN_DIR/roster.json)")
    p.add_argument("--job", help="YAML job file: fault_tolerance, cluster.gpus_per_node and run_dir "
                   "are read from it (the flags below override)")
    p.add_argument("--workers", type=int, help="worker processes on this node (default: "
                   "cluster.gpus_per_node of --job, else 1)")
    p.add_argument("--run-dir", help="run directory (default: the job's run_dir, else runs/job)")
    for flag in ("--heartbeat-s", "--lease-s", "--probe-s", "--agreement-timeout-s"):
        p.add_argument(flag, type=float)  # (default: the job's fault_tolerance, else config.py)
    p.add_argument("--startup-s", type=float, default=STARTUP_S,
                   help="how long to wait for the other agents to come up")
    p.add_argument("--quorum", choices=["majority", "none"], default="majority")
    p.add_argument("--kill-grace-s", type=float, default=FENCED_GRACE_S,
                   help="time fenced workers get to exit before they are killed")
    p.add_argument("--drain-poll-s", type=float, default=None,
                   help="ask slurmctld this often whether this node is set to DRAIN (default: "
                   "fault_tolerance.drain_poll_s of --job under Slurm, else never)")
    p.add_argument("--boost-start", action="store_true",
                   help="start the workers at a higher CPU priority until they train (a node "
                   "grown into a running job on cores it shares with the members: AgentOptions)")
    p.add_argument("--join", action="store_true",
                   help="this node is not in the roster: add it (this host's address, a free "
                   "port) and join the running job like a spare (a replacement job's agents)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- worker command and arguments")
    return p


def parse_args(argv: list[str] | None = None) -> AgentOptions:
    p = _parser()
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        if not a.job:
            p.error("give the worker command after --, or --job (worker: python -m oobleck_hpc.train)")
        command = [sys.executable, "-m", "oobleck_hpc.train"]
    heartbeat_s, lease_s, workers, run_dir = HEARTBEAT_S, LEASE_S, 1, Path("runs/job")
    drain_poll_s = 0.0
    if a.job:
        job = load_job(a.job)
        heartbeat_s, lease_s = job.fault_tolerance.heartbeat_s, job.fault_tolerance.lease_s
        workers, run_dir = job.cluster.gpus_per_node, job.resolved_run_dir
        if os.environ.get("SLURM_JOB_ID"):
            drain_poll_s = job.fault_tolerance.drain_poll_s
    heartbeat_s = a.heartbeat_s if a.heartbeat_s is not None else heartbeat_s
    lease_s = a.lease_s if a.lease_s is not None else lease_s
    if not 0 < heartbeat_s < lease_s:
        p.error(f"need 0 < --heartbeat-s ({heartbeat_s}) < --lease-s ({lease_s})")
    run_dir = Path(a.run_dir) if a.run_dir else run_dir
    roster_path = a.roster or str(run_dir / "roster.json")
    node = a.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if a.join:
        from oobleck_hpc.bootstrap.environment import node_address

        node, roster = join_roster_file(roster_path, node, node_address())
    else:
        roster = Roster.load(roster_path)
    if node not in roster.names:
        p.error(f"node {node!r} is not in the roster {roster_path} (nodes: {', '.join(roster.names)}); "
                "pass --node NAME")
    return AgentOptions(
        node=node, roster=roster, command=command,
        workers=a.workers if a.workers is not None else workers, run_dir=run_dir,
        heartbeat_s=heartbeat_s, lease_s=lease_s, probe_s=a.probe_s,
        agreement_timeout_s=a.agreement_timeout_s, startup_s=a.startup_s, quorum=a.quorum,
        kill_grace_s=a.kill_grace_s,
        drain_poll_s=a.drain_poll_s if a.drain_poll_s is not None else drain_poll_s,
        job=Path(a.job) if a.job else None, boost_start=a.boost_start)
