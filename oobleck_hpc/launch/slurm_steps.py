"""A job's node agents as one-node Slurm steps inside the allocation it runs in: what a job of a
Slurm fleet runs (`oobleck-hpc fleet submit`, launch/fleet.py, starts each job as `oobleck-hpc
run JOB --on-nodes n1,n2`). The job's launcher is the local one (launch/local.py, `LocalRun`:
the same waiting, verdict, grow requests and records); only its agents run here instead of as
local process groups, with the same interface (`procs`, `add`, `forward`, `cleanup`).

- First the discovery step on these nodes (bootstrap/discovery.py, as `submit` runs it): the
  nodes agree on RUN_DIR/roster.json, each with its address and a free port.
- Then one step per node: `srun --no-kill --kill-on-bad-exit=0 --nodes=1 --ntasks=1
  --nodelist=NODE AGENT` (the job's agent command: launch/slurm.agent_argv), its output
  appended to RUN_DIR/logs/agent-NODE.log. One step per node, not one step on all as `submit`
  runs: a node the job gives up (drained for another job of the fleet) runs another job's
  step as soon as its agent exited. Measured on Slurm 22.05: a step asked for on a node whose
  task of a running multi-node step has ended waits until that whole step ends.
- `add(count, on)`: grown nodes `on`, each its step, the agent with `--join` (it adds its node
  to the roster file, as a replacement job's agents do: control/wire.join_roster_file).
- `procs`: node -> its srun. A one-task step's srun exits with its task's exit code, and
  killing srun ends its step (measured), so the launcher treats them as the agents themselves.
- RUN_DIR/steps.json: each node's step, when it started and when it ended, rewritten
  atomically as they change (`poll`): the fleet's manager reads it to know when a node this
  job gave up is free (launch/fleet_pool.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from oobleck_hpc.files import write_json

STEPS_FILE = "steps.json"


@dataclass
class SlurmSteps:
    run_dir: Path
    agent: list[str]
    """The agent command (launch/slurm.agent_argv)."""
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    """node -> {"started": time, "ended": time or None, "code": exit code or None}."""

    @classmethod
    def start(cls, run_dir: Path, nodes: list[str], job: Any, job_path: Path,
              env: dict[str, str]) -> SlurmSteps:
        """The discovery step on `nodes`, then each node's agent step (module docstring)."""
        from oobleck_hpc.bootstrap.discovery import (DISCOVERY_FILE, DISCOVERY_LOCK,
                                                     run_discovery_step, wait_for_discovery)
        from oobleck_hpc.bootstrap.environment import detect
        from oobleck_hpc.launch.slurm import agent_argv

        slurm = detect()
        if slurm.source != "slurm":
            raise RuntimeError("--on-nodes runs the job's agents as steps of the Slurm "
                               "allocation this command runs in (SLURM_JOB_ID is not set)")
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / DISCOVERY_FILE).unlink(missing_ok=True)  # (an earlier attempt's, same job id)
        with _turn(os.environ.get(DISCOVERY_LOCK)):
            found = run_discovery_step(run_dir, nodes, python=sys.executable, mpi=job.slurm.mpi,
                                       log=run_dir / "logs" / "discovery.out")  # (its nodes)
        wait_for_discovery(run_dir, slurm.job_id, slurm.restart_count)
        agent = agent_argv(job.slurm.agent_command, python=sys.executable,
                           job_file=Path(job_path).absolute(), run_dir=run_dir.absolute())
        steps = cls(run_dir, agent, {**os.environ, **env})
        try:
            for node in found:
                steps._spawn(node)
        except BaseException:
            steps.cleanup()
            raise
        return steps

    def _spawn(self, node: str, *flags: str) -> None:
        log = self.run_dir / "logs" / f"agent-{node}.log"
        self.procs[node] = subprocess.Popen(
            ["srun", "--no-kill", "--kill-on-bad-exit=0", "--nodes=1", "--ntasks=1",
             f"--nodelist={node}", f"--job-name={self.run_dir.name}", f"--output={log}",
             "--open-mode=append", *self.agent, *flags],
            env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.steps[node] = {"started": time.time(), "ended": None, "code": None}
        self._write()

    def add(self, count: int, on: list[str] | None = None) -> list[str]:
        """Grow the running job by the nodes `on` of the allocation (`count` of them), each its
        agent's step with `--join`; returns their names."""
        if on is None or len(on) != count:
            raise ValueError(f"a job on Slurm steps grows by the nodes named: {count} asked for, "
                             f"named {on}")
        if busy := [n for n in on if n in self.procs and self.procs[n].poll() is None]:
            raise ValueError(f"the job's agents already run on {busy}")
        for node in on:
            self._spawn(node, "--join")
        return list(on)

    def poll(self) -> dict[str, int | None]:
        """Each node's exit code (None: its step runs); a step that ended is noted in
        RUN_DIR/steps.json."""
        codes = {m: p.poll() for m, p in self.procs.items()}
        ended = [m for m, c in codes.items() if c is not None and self.steps[m]["ended"] is None]
        for m in ended:
            self.steps[m].update(ended=time.time(), code=codes[m])
        if ended:
            self._write()
        return codes

    def _write(self) -> None:
        write_json(self.run_dir / STEPS_FILE, self.steps)

    def forward(self, signum: int) -> None:
        """A stop signal for every agent: srun passes SIGTERM on to its task (a single SIGINT
        only makes it print the step's state), so SIGINT goes as SIGTERM."""
        sig = signal.SIGTERM if signum == signal.SIGINT else signum
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def cleanup(self) -> None:
        """Kill every step still running (killing its srun ends it)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        self.poll()


@contextlib.contextmanager
def _turn(lock: str | None) -> Iterator[None]:
    """Hold an exclusive flock on the file `lock` (None: no lock)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # (released when the file closes)
        yield
