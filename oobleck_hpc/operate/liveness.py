"""The job's side of the watchdog's contract (operate/watch.py): the files a job writes so that
an independent watchdog can tell whether it lives, progresses, and how it ended. The launcher
and the training loop call these; the watchdog only reads them.

    RUN_DIR/run.json     `write_run_record`: how to start the job again (argv, cwd, env), and for
                         Slurm jobs the job id. Restarting = running that argv again.
    RUN_DIR/job.lock     `JobLock`: an flock the job's main process takes FIRST (before importing
                         torch) and holds for its whole life. The kernel drops it when the process
                         dies, however it dies (SIGKILL included), so "lock held" is the liveness
                         test; the file names the holder (pid, host). A second copy of the job
                         fails to take the lock and refuses to run.
    RUN_DIR/heartbeat    `beat(run_dir, step)`: the last completed step (atomic replace).
    RUN_DIR/exit.json    `record_exit(run_dir, code, reason)`: how the job ended, when it could say.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

from oobleck_hpc.errors import OobleckError
from oobleck_hpc.files import write_json
from oobleck_hpc.polling import wait_until

RUN_RECORD = "run.json"
JOB_LOCK = "job.lock"
HEARTBEAT = "heartbeat"
EXIT_RECORD = "exit.json"


class WatchError(OobleckError):
    """The watchdog cannot do its job (bad target, another watchdog, no way to restart), or a
    job cannot take its lock (a copy of it is running)."""


def write_run_record(run_dir: str | Path, argv: list[str], *, cwd: str | None = None,
                     env: dict[str, str] | None = None, slurm_job_id: str | None = None,
                     checkpoint_dir: str | None = None) -> Path:
    """Record how to start this job again (called by the launcher when it starts a job)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_RECORD
    write_json(path, {"argv": list(argv), "cwd": cwd or os.getcwd(), "env": env or {},
                      "slurm_job_id": slurm_job_id, "checkpoint_dir": checkpoint_dir,
                      "written_at": time.time(), "host": socket.gethostname()},
               durable=True, indent=None)
    return path


def beat(run_dir: str | Path, step: int) -> None:
    """Training progress: `step` steps are complete (call at each step boundary, or every few)."""
    write_json(Path(run_dir) / HEARTBEAT, {"step": int(step), "time": time.time(),
                                           "pid": os.getpid()}, durable=True, indent=None)


def record_exit(run_dir: str | Path, code: int, reason: str = "", outcome=None) -> None:
    """How the job ended (0 done; 2/3 do not requeue; 75 requeue); with the run's `outcome`
    (runs.Outcome: the verdict the code follows), whether and where it finished."""
    record = {"code": int(code), "reason": reason, "time": time.time(), "pid": os.getpid()}
    if outcome is not None:
        record.update(finished=outcome.finished, outcome=outcome.describe(),
                      last_step=outcome.last_step, total=outcome.total)
    write_json(Path(run_dir) / EXIT_RECORD, record, durable=True, indent=None)


class JobLock:
    """Held by the job's main process while it lives; refuses a second copy of the job.

        with JobLock(run_dir):      # WatchError if the job is already running
            ... train ...

    An flock on RUN_DIR/job.lock (the kernel drops it when the process dies, SIGKILL included;
    on NFS it is a POSIX lock on the server). The file also holds the holder's pid and host.
    Children started with exec (subprocess) do not inherit it; a fork()ed child that outlives its
    parent keeps it, and then the job is indeed still running.
    """

    def __init__(self, run_dir: str | Path, wait_s: float = 2.0):
        self.path = Path(run_dir) / JOB_LOCK
        self.wait_s = wait_s
        self._fd: int | None = None

    def acquire(self) -> JobLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

        def take() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                return False

        try:  # a watchdog's probe holds the lock for microseconds: retry briefly
            wait_until(take, self.wait_s, f"the lock {self.path}", every_s=0.05)
        except TimeoutError:
            os.close(fd)
            raise WatchError(f"{self.path}: the job is already running ({lock_holder(self.path)}"
                             f"); not starting a second copy") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        # A fresh run starts without the previous run's exit record.
        (self.path.parent / EXIT_RECORD).unlink(missing_ok=True)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JobLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_holder(path: str | Path) -> str | None:
    """Who holds the flock on `path` ("pid=P host=H"), or None when nobody does.

    Probes by taking the lock without blocking and releasing it at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid=?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holder_pid(holder: str | None) -> int | None:
    """The pid of a `lock_holder` on this host (one that can be signalled from here), else None."""
    if holder is None:
        return None
    fields = dict(kv.split("=", 1) for kv in holder.split() if "=" in kv)
    if fields.get("host") not in (None, socket.gethostname()):
        return None  # held on another node: cannot signal it from here
    return int(fields["pid"]) if fields.get("pid", "").isdigit() else None
