"""One job of a fleet (launch/fleet.py): its launcher, `oobleck-hpc run JOB --run-dir
FLEET_DIR/<job> --nodes K --max-requeues 0` in its own process session (with `--on-nodes` in a
Slurm fleet: its agents as steps on those nodes of the allocation, launch/slurm_steps.py), and
its events. The manager that started it may die; the launcher trains on, and a manager that
takes over watches it by pid and by its `run_ended` event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from oobleck_hpc.bootstrap.discovery import DISCOVERY_LOCK
from oobleck_hpc.records.events import read_events
from oobleck_hpc.records.story import Tail

POLL_S = 0.2
STATE = "manager.json"
"""The fleet manager's records in the fleet's run dir (launch/fleet.py)."""


def process_start(pid: int) -> int | None:
    """The start time of a live process (/proc, clock ticks since boot: with the pid, its
    identity); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass
class FleetJobRun:
    """One job of the fleet on this machine: its launcher process and its events."""

    name: str
    job_file: Path
    run_dir: Path
    proc: subprocess.Popen | None = None
    """The launcher, when this manager started it."""
    pid: int | None = None
    pid_start: int | None = None
    """The launcher's pid and start time (process_start), whoever started it."""
    attempt: int | None = None
    """The attempt its launcher runs (0 first, k after its k-th requeue in the fleet); None
    before it started."""
    watching: bool = False
    """Its launcher runs, or ran and its end was not handled yet."""
    ended: dict[str, Any] | None = None
    """The attempt's `run_ended` event, once read."""
    tail: Tail | None = None
    log: IO[bytes] | None = None

    def start(self, nodes: int, attempt: int, on: list[str] | None = None) -> int:
        """Start its launcher (`on`: on these nodes of the Slurm allocation); an attempt after
        a fallback continues the run (the launcher's watchdog-restart path,
        OOBLECK_RESTART_COUNT: same records, from the checkpoint) with the job file's injected
        `faults:` left out (they belong to the first run, as in the launcher's own requeue:
        launch/cli.py)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        job_file = self.job_file
        env = {k: v for k, v in os.environ.items()  # (its attempt is the fleet's to say)
               if k not in ("OOBLECK_RUN_ID", "OOBLECK_REQUEUE_COUNT", "OOBLECK_ATTEMPT")}
        env["OOBLECK_RESTART_COUNT"] = str(attempt)
        if attempt > 0:
            import yaml

            from oobleck_hpc.config import load_job

            job_file = self.run_dir.parent / f"{self.name}-attempt{attempt}.yaml"
            this = load_job(self.job_file, {"faults": []}).to_dict()
            job_file.write_text(yaml.safe_dump(json.loads(json.dumps(this)), sort_keys=False))
            env["OOBLECK_ATTEMPT"] = f"fleet-{attempt}"
        cmd = [sys.executable, "-m", "oobleck_hpc", "run", str(job_file), "--run-dir",
               str(self.run_dir), "--nodes", str(nodes), "--max-requeues", "0"]
        if on is not None:
            cmd += ["--on-nodes", ",".join(on)]
            env[DISCOVERY_LOCK] = str(self.run_dir.parent / "discovery.lock")
        if self.log is None:
            self.log = open(self.run_dir.parent / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid, self.pid_start = self.proc.pid, process_start(self.proc.pid)
        self._watch(attempt)
        return self.proc.pid

    def _watch(self, attempt: int) -> None:
        self.attempt, self.watching, self.ended = attempt, True, None
        if self.tail is None:
            self.tail = Tail(self.run_dir / "events.jsonl")

    def adopt(self, saved: dict[str, Any]) -> None:
        """Watch a launcher that a manager before this one started."""
        self.pid, self.pid_start = saved["pid"], saved["pid_start"]
        self._watch(saved["attempt"])
        self.watching = saved["watching"]
        assert self.tail is not None
        self.tail.offset = int(saved["offset"])

    def find(self, attempt: int) -> bool:
        """Watch the launcher of `attempt` if one started (its `run_started` event names its
        pid: a manager that died as it started it did not record it)."""
        path = self.run_dir / "events.jsonl"
        for e in read_events(path) if path.exists() else []:
            if e.get("kind") == "run_started" and e.get("attempt") == attempt:
                pid = e.get("pid")
                self.proc, self.pid = None, pid
                self.pid_start = process_start(pid) if pid is not None else None
                self._watch(attempt)
                return True
        return False

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and self.pid_start is not None \
            and process_start(self.pid) == self.pid_start

    def exit_code(self) -> int | None:
        """Its launcher's exit code once it exited (None while it runs): its own, or, for a
        launcher adopted from an earlier manager, the code of its `run_ended` event (1 if it
        left none)."""
        if self.proc is not None:
            return self.proc.poll()
        if self.alive() or (self.pid is None and self.ended is None):
            return None  # (its pid unknown: its last word, `run_ended`)
        return int(self.ended["code"]) if self.ended is not None else 1

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the launcher forwards it and checkpoints), then SIGKILL what is left."""
        from oobleck_hpc.operate.cleanup import kill_agents, kill_leftovers

        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            kill_leftovers(self.proc, self.run_dir)
        elif self.alive() and self.pid is not None:  # (adopted: not our child, by pid)
            os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if self.alive():
                os.killpg(self.pid, signal.SIGKILL)  # (its session: start_new_session)
            kill_agents(self.run_dir)
        if self.log is not None:
            self.log.close()
