"""What runs inside a submitted Slurm job (launch/slurm.py submits it; its docstring has the
job's shape and why each flag): `SlurmDriver`, the submitit callable of the batch script
(discovery step, the agents' step, the verdict, requeue), `JoinDriver`, that of a replacement
job, and `LaunchResult`, what the driver returns. No submitit here: submitit pickles these
callables on the login node and runs them in the batch script.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oobleck_hpc.bootstrap.discovery import TooFewNodes, run_discovery_step, wait_for_discovery
from oobleck_hpc.bootstrap.environment import current_job_nodes, detect
from oobleck_hpc.diagnostics import configure
from oobleck_hpc.errors import EXIT_OK, EXIT_REQUEUE
from oobleck_hpc.files import write_json
from oobleck_hpc.launch.slurm_task import (begin_run, end_replacements, nodes_left,
                                          recorded_outcome, requeue, run_verdict)
from oobleck_hpc.launch.supervise import Supervisor
from oobleck_hpc.polling import wait_until
from oobleck_hpc.records import runs

logger = logging.getLogger(__name__)

REQUEUE_TIMEOUT_S = 600
"""How long the driver waits for Slurm to take its `scontrol requeue` (Restarts grows)."""
MANAGER_RESTARTS = 3
"""How many times a Slurm fleet's batch script starts a new manager after one died."""


@dataclass
class LaunchResult:
    """What the driver returns (the submitit job's result): how the agents' step ended."""

    job_id: str
    restart_count: int
    nodes: list[str]
    """Nodes the agents were started on (the discovery roster)."""
    lost_nodes: list[str]
    """Nodes the controller dropped from the job while the agents ran (node failures)."""
    exit_code: int
    """The verdict over the surviving agents' exit codes (see `verdict`)."""
    discovery_s: float
    run_s: float
    log_dir: str
    events: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict, log_dir: str) -> LaunchResult:
        """From RUN_DIR/launch-JOB-rK.json, written by the driver or by the last agent
        (slurm_task.finish_without_driver, which records no timings)."""
        return cls(job_id=record["job_id"], restart_count=record["restart_count"],
                   nodes=record["nodes"], lost_nodes=record["lost_nodes"],
                   exit_code=record["exit_code"], discovery_s=record.get("discovery_s", 0.0),
                   run_s=record.get("run_s", 0.0), log_dir=record.get("log_dir", log_dir),
                   events=record.get("events", [f"finished by the agent on "
                                                f"{record.get('finished_by')} after the batch "
                                                f"host {record.get('batch_host_lost')} was lost"]))


@dataclass
class SlurmDriver:
    """The callable submitit runs in the batch script (once, on the first node)."""

    job_file: str
    run_dir: str
    agent: list[str]
    mpi: str = "pmix"
    python: str = sys.executable
    min_nodes: int = 1
    """The fewest nodes the job's plan accepts (`min_nodes`): below it, requeue and wait."""
    members: int = 0
    """Generation 0's node count (`members`): the allocation's nodes after it are spares."""
    group_access: bool = False
    """The job's: the run's files are also its user's group's to read (records/runs.py, "Private")."""

    def __call__(self) -> LaunchResult:
        configure("INFO")  # submitit's process: the supervisor's lines reach the batch log
        env = detect()
        if env.source != "slurm":
            raise RuntimeError("SlurmDriver runs inside a Slurm batch job (SLURM_JOB_ID unset)")
        run_dir = Path(self.run_dir)
        os.umask(runs.umask(self.group_access))  # the run's files and its steps' (srun passes it)
        begin_run(run_dir, env.job_id, env.restart_count, self.group_access)  # + OOBLECK_RUN_ID
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        tag = f"{env.job_id}-r{env.restart_count}"
        recorded = recorded_outcome(run_dir, env.job_id, env.restart_count)
        if recorded is not None:  # the last agent requeued the job to publish this (slurm_task)
            return self._end(LaunchResult.from_record(recorded, str(logs)))
        nodes = current_job_nodes(env.job_id)  # fresh even if SLURM_JOB_NODELIST is stale
        events = [f"start job {env.job_id} restart {env.restart_count} nodes {nodes}"]

        t0 = time.monotonic()
        try:
            nodes = run_discovery_step(run_dir, nodes, python=self.python, mpi=self.mpi,
                                       log=logs / f"discovery-{tag}.out",
                                       min_nodes=self.min_nodes, members=self.members)
        except TooFewNodes as e:
            logger.warning("%s; requeueing job %s", e, env.job_id)
            self._requeue(env.job_id, run_dir, tag, reason=str(e))
        found = wait_for_discovery(run_dir, env.job_id, env.restart_count, timeout_s=30)
        roster = list(found.roster.names)
        discovery_s = time.monotonic() - t0
        events.append(f"discovery {discovery_s:.2f} s: {roster}, digest {found.digest}")

        t1, since = time.monotonic(), time.time()
        (run_dir / "exit" / tag).mkdir(parents=True, exist_ok=True)  # one file per node (slurm_task)
        agents = ["srun", "--no-kill", "--kill-on-bad-exit=0", f"--nodes={len(roster)}",
                  f"--ntasks={len(roster)}", "--ntasks-per-node=1", f"--nodelist={','.join(roster)}",
                  f"--output={logs}/agent-{tag}-%t.out", self.python, "-m",
                  "oobleck_hpc.launch.slurm_task", "--run-dir", str(run_dir), "--tag", tag, "--",
                  *self.agent]
        supervisor = Supervisor(Path(self.job_file), run_dir, env.job_id, roster, since,
                                self.python)
        supervisor.start()
        # the last agent requeues the job when this node dies (slurm_task): on the nodes left
        step_rc = subprocess.run(agents, env={**os.environ,
                                              "OOBLECK_MIN_NODES": str(self.min_nodes)}).returncode
        supervisor.stop.set()
        run_s = time.monotonic() - t1
        survivors = set(current_job_nodes(env.job_id))
        lost = [n for n in roster if n not in survivors]
        rc, codes, out = run_verdict(run_dir, tag)
        events.append(f"agents step exited {step_rc} after {run_s:.1f} s; lost nodes {lost}; "
                      f"exit codes {codes}; the run {out.describe()}; verdict {rc}")
        result = LaunchResult(env.job_id, env.restart_count, roster, lost, rc, discovery_s, run_s,
                              str(logs), events)
        write_json(run_dir / f"launch-{tag}.json", result.to_dict())
        end_replacements(run_dir, f"the job's run ended with exit {rc}")
        if rc == EXIT_REQUEUE:
            self._requeue(env.job_id, run_dir, tag, nodes_left(roster, codes, self.min_nodes))
        return self._end(result)

    @staticmethod
    def _end(result: LaunchResult) -> LaunchResult:
        """Return the result (submitit publishes it; the job ends COMPLETED), or leave with the
        verdict as the batch script's exit code (sacct: FAILED with that code; `wait_result`
        reads the result from RUN_DIR/launch-JOB-rK.json)."""
        if result.exit_code == EXIT_OK:
            return result
        logger.error("job %s ended with exit %s (lost nodes %s); see %s", result.job_id,
                     result.exit_code, result.lost_nodes, result.log_dir)
        raise SystemExit(result.exit_code)  # not an Exception: submitit lets it end the process

    @staticmethod
    def _requeue(job_id: str, run_dir: Path, tag: str, nodes: int | None = None,
                 reason: str = "") -> None:
        """Ask Slurm to requeue this job (on `nodes` nodes: slurm_task.requeue), then wait until
        it has (Restarts grows) and leave without a result: returning would make submitit
        publish a result for a job that is coming back. Leaving by ourselves also matters where
        Slurm tracks processes by parentage (proctrack/linuxproc): this process outlives the
        killed batch shell there."""
        before = _restarts(job_id)
        requeue(job_id, run_dir, tag, nodes, reason)
        try:
            wait_until(lambda: _restarts(job_id) != before, REQUEUE_TIMEOUT_S,
                       f"Slurm to requeue job {job_id}", every_s=1.0)
        except TimeoutError as e:
            logger.warning("%s; leaving anyway", e)
        os._exit(EXIT_REQUEUE)


@dataclass
class JoinDriver:
    """The callable a replacement job runs in its batch script: one agent per node, each with
    `--join` (it adds its node to the running job's roster and joins like a spare)."""

    run_dir: str
    agent: list[str]
    group_access: bool = False
    """The job's (SlurmDriver.group_access)."""

    def __call__(self) -> int:
        os.umask(runs.umask(self.group_access))  # the agents' files (srun passes it on)
        env = detect()
        nodes = current_job_nodes(env.job_id)
        logs = Path(self.run_dir) / "logs"
        return subprocess.run(
            ["srun", "--no-kill", "--kill-on-bad-exit=0", f"--nodes={len(nodes)}",
             f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
             f"--output={logs}/agent-join-{env.job_id}-%t.out", *self.agent, "--join"]).returncode


@dataclass
class FleetDriver:
    """The callable of a Slurm fleet's batch script (`oobleck-hpc fleet submit`): the fleet's
    manager, `oobleck-hpc fleet run FLEET --run-dir DIR --slurm` (launch/fleet.py), which
    starts each job on nodes of this allocation. A manager that dies (killed, crashed) leaves
    its records with the fleet not ended, and its jobs train on: a new one takes over from
    them (`--resume`), at most MANAGER_RESTARTS times; only re-allocation pauses meanwhile.
    Returns the last manager's exit code 0 (every job finished), or leaves with it (submitit:
    no result; `fleet status DIR` tells the jobs)."""

    fleet_file: str
    run_dir: str
    python: str = sys.executable

    def manager(self) -> list[str]:
        """The manager's command line (`fleet submit --dry-run` prints it)."""
        return [self.python, "-m", "oobleck_hpc", "fleet", "run", self.fleet_file,
                "--run-dir", self.run_dir, "--slurm"]

    def __call__(self) -> int:
        configure("INFO")
        manager = self.manager()
        rc = subprocess.run(manager).returncode
        for _ in range(MANAGER_RESTARTS):
            if not _manager_died(Path(self.run_dir)):
                break
            logger.warning("the fleet's manager died (exit %s) before the fleet ended: a new "
                           "one takes over from its records", rc)
            rc = subprocess.run([*manager, "--resume"]).returncode
        if rc != EXIT_OK:
            raise SystemExit(rc)
        return rc


def _manager_died(run_dir: Path) -> bool:
    """The fleet's manager left records of a fleet that has not ended (launch/fleet.py)."""
    from oobleck_hpc.launch.fleet_job import STATE

    try:
        return not json.loads((run_dir / STATE).read_text()).get("ended")
    except (OSError, ValueError):
        return False  # (it died before it wrote any: nothing runs to take over)


def _restarts(job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=60).stdout
    match = re.search(r"Restarts=(\d+)", out)
    return int(match.group(1)) if match else -1
