"""An independent watchdog: bring back a job that died without being requeued or stopped making
progress, from its latest checkpoint -- and never start a second copy of a job that is alive.

`oobleck-hpc watch RUN_DIR` (local form) or `oobleck-hpc watch JOB_ID` (Slurm form) polls every
`interval_s` and decides, from observations only, one of:

    alive     the job holds its lock (local) or Slurm lists it as pending/running/requeued
    stalled   alive, but the step in RUN_DIR/heartbeat has not advanced for `stall_s`
              -> stop it (SIGTERM, then SIGKILL after `grace_s`; Slurm: `scontrol requeue`) and restart
    died      not alive, no exit record saying it finished or must not be requeued, and no sign
              of life in the run dir for `startup_s` (a job just launched takes its lock only
              after the Python start-up)
              -> restart (its checkpoint.dir holds the latest good checkpoint; the job resumes from it)
    finished  exit record 0 (or Slurm COMPLETED)                 -> stop watching, exit 0
    refused   exit record 2 or 3 (bad input, unrecoverable)      -> stop watching, exit 3

What a job writes for the watchdog -- RUN_DIR/run.json (how to start it again), job.lock (held
while it lives), heartbeat (its last step), exit.json (how it ended) -- is operate/liveness.py.

Only one watchdog per run dir (RUN_DIR/watch.lock, held while watching). A restarted job gets
OOBLECK_ATTEMPT=watch-<n> so its checkpoint writes never mix with the dead run's leftovers.

Slurm form: liveness from `squeue -h -j ID -o %T`, the end state from `sacct`; a job that ended
FAILED / NODE_FAIL / TIMEOUT / PREEMPTED / OUT_OF_MEMORY / BOOT_FAIL / DEADLINE (not requeued by
Slurm, i.e. no longer in squeue) is resubmitted: with RUN_DIR/run.json's argv (e.g.
`oobleck-hpc submit job.yaml`) when a run dir is known, otherwise `sbatch --chdir WORKDIR COMMAND`
read from `scontrol show job` while the job was still known. CANCELLED is a person's decision
and is left alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNRECOVERABLE
from oobleck_hpc.operate.liveness import (EXIT_RECORD, HEARTBEAT, JOB_LOCK, RUN_RECORD, WatchError,
                                          holder_pid, lock_holder)
from oobleck_hpc.polling import wait_until

WATCH_LOCK = "watch.lock"
NO_REQUEUE_CODES = (EXIT_BAD_INPUT, EXIT_UNRECOVERABLE)
SLURM_ALIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
               "SUSPENDED", "CONFIGURING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD",
               "SPECIAL_EXIT", "STOPPED"}
SLURM_RESUBMIT = {"FAILED", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
                  "DEADLINE"}


@dataclass
class Observation:
    alive: bool
    exit_code: int | None = None
    """From exit.json (local) or sacct (Slurm); None if the job could not say."""
    step: int | None = None
    """The heartbeat's step."""
    pid: int | None = None
    state: str = ""
    """Slurm state, or 'locked' / 'unlocked' / 'starting' locally."""
    quiet_s: float | None = None
    """Local: seconds since the run dir last showed life (run.json, job.lock, heartbeat written)."""


@dataclass
class Decision:
    action: str
    """'wait' | 'restart' | 'stop-and-restart' | 'finished' | 'refused' | 'gave-up'"""
    why: str


@dataclass
class _Progress:
    step: int | None = None
    since: float = 0.0


@dataclass
class Watchdog:
    """Watches one run dir (local) or one Slurm job and restarts it when it must."""

    run_dir: Path | None
    job_id: str | None = None
    interval_s: float = 30.0
    stall_s: float = 1800.0
    grace_s: float = 30.0
    startup_s: float = 60.0
    """A job that left no exit record is declared dead only when its run dir has shown no sign of
    life for this long (a job just launched is importing torch before it takes its lock)."""
    max_restarts: int = 10
    run: Callable[..., Any] = subprocess.run
    log: Callable[[str], None] = field(default=lambda m: print(f"[watch] {m}", file=sys.stderr, flush=True))
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    _progress: _Progress = field(default_factory=_Progress)
    _child: subprocess.Popen | None = None
    _slurm_command: tuple[str, str] | None = None

    # -- observe
    def observe(self) -> Observation:
        hb_step = self._heartbeat_step()
        if self.job_id is not None:
            return self._observe_slurm(hb_step)
        assert self.run_dir is not None
        holder = lock_holder(self.run_dir / JOB_LOCK)
        if holder is not None:
            return Observation(True, step=hb_step, pid=holder_pid(holder), state=f"locked, {holder}")
        if self._child is not None and self._child.poll() is None:
            # Just started by us and not yet holding its lock.
            return Observation(True, step=hb_step, pid=self._child.pid, state="starting")
        code = None
        try:
            code = json.loads((self.run_dir / EXIT_RECORD).read_text())["code"]
        except (FileNotFoundError, ValueError, KeyError):
            pass
        if code is None and self._child is not None:
            rc = self._child.returncode
            code = rc if rc is not None and rc >= 0 else None
        return Observation(False, exit_code=code, step=hb_step, state="unlocked",
                           quiet_s=self._quiet_s())

    def _quiet_s(self) -> float:
        assert self.run_dir is not None
        last = 0.0
        for name in (RUN_RECORD, JOB_LOCK, HEARTBEAT):
            try:
                last = max(last, (self.run_dir / name).stat().st_mtime)
            except FileNotFoundError:
                pass
        return time.time() - last

    def _heartbeat_step(self) -> int | None:
        if self.run_dir is None:
            return None
        try:
            return int(json.loads((self.run_dir / HEARTBEAT).read_text())["step"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def _observe_slurm(self, hb_step: int | None) -> Observation:
        out = self.run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], capture_output=True, text=True)
        state = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
        if state in SLURM_ALIVE:
            if self._slurm_command is None:
                self._slurm_command = self._scontrol_command()
            return Observation(True, step=hb_step, state=state)
        acct = self.run(["sacct", "-j", self.job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                        capture_output=True, text=True)
        line = acct.stdout.strip().splitlines()[-1] if acct.returncode == 0 and acct.stdout.strip() else ""
        if not line:
            raise WatchError(f"Slurm knows no job {self.job_id} (squeue and sacct are empty); "
                             f"pass the job's run dir instead")
        st, _, exit_code = line.partition("|")
        st = st.split()[0]  # "CANCELLED by 1000" -> "CANCELLED"
        code = int(exit_code.split(":")[0]) if exit_code.split(":")[0].isdigit() else None
        return Observation(False, exit_code=code, step=hb_step, state=st)

    def _scontrol_command(self) -> tuple[str, str] | None:
        out = self.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True)
        fields = dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)
        if out.returncode == 0 and fields.get("Command") and fields.get("WorkDir"):
            return fields["WorkDir"], fields["Command"]
        return None

    # -- decide (pure given the observation and the remembered progress)
    def decide(self, obs: Observation) -> Decision:
        now = self.clock()
        if obs.alive:
            if obs.step != self._progress.step or self._progress.since == 0.0:
                self._progress = _Progress(obs.step, now)
                return Decision("wait", f"alive ({obs.state}), step {obs.step}")
            idle = now - self._progress.since
            if idle >= self.stall_s and self.run_dir is not None:
                return Decision("stop-and-restart", f"alive but step {obs.step} has not advanced "
                                                     f"for {idle:.0f} s (stall_s={self.stall_s:.0f})")
            return Decision("wait", f"alive ({obs.state}), step {obs.step} for {idle:.0f} s")
        self._progress = _Progress()
        if obs.state == "COMPLETED" or (self.job_id is None and obs.exit_code == EXIT_OK):
            return Decision("finished", "the job finished")
        if obs.exit_code in NO_REQUEUE_CODES:
            return Decision("refused", f"the job exited with {obs.exit_code} (do not requeue: fix "
                                       f"the input or the error in its log)")
        if obs.state == "CANCELLED":
            return Decision("refused", "the job was cancelled by a person; not resubmitting")
        if self.job_id is not None and obs.state not in SLURM_RESUBMIT and obs.state != "COMPLETED":
            return Decision("wait", f"Slurm state {obs.state}")
        if obs.exit_code is None and obs.quiet_s is not None and obs.quiet_s < self.startup_s:
            # Launched but not yet holding its lock, or died a moment ago: look again later.
            return Decision("wait", f"not holding its lock; last sign of life {obs.quiet_s:.0f} s "
                                    f"ago (startup_s={self.startup_s:.0f})")
        if self.restarts >= self.max_restarts:
            return Decision("gave-up", f"died again after {self.restarts} restarts "
                                       f"(max_restarts={self.max_restarts})")
        how = "exit code " + str(obs.exit_code) if obs.exit_code is not None else "no exit record"
        return Decision("restart", f"not running ({obs.state}, {how})")

    # -- act
    def step(self) -> Decision:
        obs = self.observe()
        d = self.decide(obs)
        if d.action == "stop-and-restart":
            self.log(d.why)
            if self.restarts >= self.max_restarts:
                return Decision("gave-up", f"stalled after {self.restarts} restarts")
            self._stop(obs)
            if self.job_id is not None:  # Slurm requeued it: same job id, it resumes by itself
                self.restarts += 1
                self._progress = _Progress()
            else:
                self._restart()
        elif d.action == "restart":
            self.log(d.why)
            self._restart()
        return d

    def _stop(self, obs: Observation) -> None:
        if self.job_id is not None:
            self.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True)
            return
        assert self.run_dir is not None
        if obs.pid is None:
            raise WatchError(f"{self.run_dir / JOB_LOCK} is held ({obs.state}) by a process this "
                             f"watchdog cannot signal (another host?); stop it there")
        lock = self.run_dir / JOB_LOCK

        def released() -> bool:
            self._reap()
            return lock_holder(lock) is None

        for sig, wait in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(obs.pid, sig) if os.getpgid(obs.pid) == obs.pid else os.kill(obs.pid, sig)
            except ProcessLookupError:
                pass
            try:
                wait_until(released, wait, f"pid {obs.pid} to release {lock}", every_s=0.05)
                break
            except TimeoutError:
                pass
        else:
            raise WatchError(f"pid {obs.pid} still holds {lock} after SIGKILL; "
                             f"not starting a second copy")
        self._reap()

    def _reap(self) -> None:
        if self._child is not None:
            self._child.poll()

    def _restart(self) -> None:
        self.restarts += 1
        self._progress = _Progress()
        record = None
        if self.run_dir is not None and (self.run_dir / RUN_RECORD).exists():
            record = json.loads((self.run_dir / RUN_RECORD).read_text())
        if record is None and self.job_id is not None:
            if self._slurm_command is None:
                raise WatchError(f"job {self.job_id} ended and neither a run dir with {RUN_RECORD} "
                                 f"nor its batch script (scontrol) is known; cannot resubmit")
            workdir, command = self._slurm_command
            out = self.run(["sbatch", "--parsable", "--chdir", workdir, command],
                           capture_output=True, text=True)
            if out.returncode != 0:
                raise WatchError(f"sbatch {command} failed: {out.stderr.strip()}")
            self.job_id = out.stdout.strip().split(";")[0]
            self.log(f"resubmitted as Slurm job {self.job_id} (restart {self.restarts})")
            return
        if record is None:
            raise WatchError(f"{self.run_dir}/{RUN_RECORD} is missing: the watchdog does not know "
                             f"how to start this job; start it with `oobleck-hpc run`, which "
                             f"writes it")
        env = {**os.environ, **record.get("env", {}), "OOBLECK_ATTEMPT": f"watch-{self.restarts}",
               "OOBLECK_RESTART_COUNT": str(self.restarts)}
        if self.job_id is not None or record.get("slurm_job_id"):
            out = self.run(record["argv"], cwd=record["cwd"], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise WatchError(f"resubmitting with {shlex.join(record['argv'])} failed: "
                                 f"{out.stderr.strip()}")
            new_id = _parse_job_id(out.stdout)
            if new_id:
                self.job_id = new_id
            self.log(f"resubmitted ({shlex.join(record['argv'])}) as job {self.job_id}")
            return
        (self.run_dir / EXIT_RECORD).unlink(missing_ok=True)
        path = self.run_dir / f"watch-restart-{self.restarts}.log"  # (mode: records/runs.py, "Private")
        log = open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640), "ab")
        self._child = subprocess.Popen(record["argv"], cwd=record["cwd"], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.log(f"restarted: {shlex.join(record['argv'])} (pid {self._child.pid}, "
                 f"restart {self.restarts}, log {path})")

    def loop(self, once: bool = False) -> int:
        """Watch until the job finishes, is refused, or restarts run out. Returns the exit code
        for the `watch` command: 0 finished, 3 refused or gave up."""
        with _WatchLock(self.run_dir):
            while True:
                d = self.step()
                if d.action in ("finished", "refused", "gave-up"):
                    self.log(d.why)
                    return EXIT_OK if d.action == "finished" else EXIT_UNRECOVERABLE
                if once:
                    self.log(d.why)
                    return EXIT_OK
                time.sleep(self.interval_s)


def _parse_job_id(text: str) -> str | None:
    for token in reversed(text.replace(";", " ").split()):
        if token.isdigit():
            return token
    return None


class _WatchLock:
    """One watchdog per run dir."""

    def __init__(self, run_dir: Path | None):
        self.path = None if run_dir is None else run_dir / WATCH_LOCK
        self._fd: int | None = None

    def __enter__(self) -> _WatchLock:
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise WatchError(f"{self.path}: another watchdog (pid {lock_holder(self.path)}) watches "
                             f"this run; stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)


def watchdog_for(target: str, **kw: Any) -> Watchdog:
    """`target`: a run dir (local or Slurm, from its run.json) or a Slurm job id."""
    path = Path(target)
    if path.is_dir():
        job_id = None
        if (path / RUN_RECORD).exists():
            job_id = json.loads((path / RUN_RECORD).read_text()).get("slurm_job_id")
        elif not (path / JOB_LOCK).exists():
            raise WatchError(f"{target}: a directory without {RUN_RECORD} or {JOB_LOCK}; pass the "
                             f"run dir of a job (runs/<name>) or a Slurm job id")
        return Watchdog(path, job_id=job_id, **kw)
    if target.replace("_", "").isdigit():
        return Watchdog(None, job_id=target, **kw)
    raise WatchError(f"{target!r} is neither a run directory nor a Slurm job id")
