"""Run records: which run and which attempt wrote a record, and where each run's records live.

A *run* is one launch of a job: one `oobleck-hpc run` (with its local requeues and watchdog
restarts), or one Slurm job (with all its requeues: the same job id). Its id is
`YYYYmmdd-HHMMSS-xxxx` (local, UTC) or `slurm-JOBID`. An *attempt* is one start of the run's
processes: 0 first, then one more per requeue or restart (`attempt()`).

Every event (`records/events.py`) and every metrics line carries both (`run`, `attempt`), and a
run directory only ever holds ONE run's records: when a new run starts, the launcher
(`begin`) moves the previous run's records into RUN_DIR/history/<its run id>/. The layout:

    RUN_DIR/                     (the job's run_dir; default runs/<job name>)
      run-id                     the current run's id
      events.jsonl               every transition of the run, each with t, kind, source, run, attempt
      metrics.jsonl              one line per committed step (step 1..N), each with run, attempt
      logs/                      this attempt's per-node agent logs (logs-attempt<k>/: earlier ones)
      final/                     final parameters (train.save_final_params)
      exit.json  requeue.json  agents.json  roster.json  exit/  launch-*.json   (launchers)
      drain/                     drain requests (control/drain.py: oobleck-hpc drain)
      run.json  heartbeat  job.lock  job.yaml  submitit/   (kept across runs: watch, submit)
      history/<run id>/          an earlier run's records, same names (the last KEEP_RUNS runs)

The job's verdict is the run's record (`outcome`, `verdict`): the run *finished* when its last
step is committed -- the current plan's rank 0 writes the `run_finished` event (with the job's
step count) only after every rank reached the end and the final state is written, and the
metrics file then holds the last step. Every launcher (the local one, the Slurm driver and its
batch script, the last agent of a job that lost its batch host), `exit.json`, the console and
`oobleck-hpc report` decide it through these two functions. A process's exit code says how
that node ended (finished, drained, lost, excluded, fenced, bad input), never how the job did.

Private: a run's files are its user's alone. RUN_DIR is made 0700 when a run begins
(`make_run_dir`), and the launchers create everything under `private_files()`: umask 077,
inherited by the agents, the workers and Slurm's steps, so directories are 0700 and files 0600
-- checkpoints (weights, optimizer state), final/, logs, events, the roster with every port,
RUN_DIR/secret (the control plane's key, control/auth.py), job.yaml and the drain and grow
requests (control inputs). A job file's `group_access: true` (a team's run) makes it umask 027:
0750 and 0640, readable by the user's group, writable by nobody else; the secret stays 0600. A
request file (drain, grow) counts only when the job's user owns it (`read_own`): others are
ignored, with an event that says so.

Stdlib only: the Slurm wrapper (launch/slurm_task.py) and the event log import it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REQUEUE, EXIT_UNRECOVERABLE
from oobleck_hpc.files import write_atomic

PRIVATE_UMASK = 0o077
"""What the launchers create is for the job's user alone (module docstring) ..."""
GROUP_UMASK = 0o027
"""... or, with the job's `group_access`, also readable by the user's group."""
RUN_ID_FILE = "run-id"
HISTORY = "history"
KEEP_RUNS = 20
"""Earlier runs kept under RUN_DIR/history (the oldest go first)."""
REQUEUE_RECORD = "requeue.json"
"""RUN_DIR/requeue.json: why rank 0 asked for a requeue (exit 75) and the nodes still alive
(checkpoint/resume.py writes it; the requeue loops, launch/requeue.py and launch/slurm_task.py, read it)."""
PER_RUN = ("events.jsonl", "metrics.jsonl", "logs", "logs-attempt*", "final", "exit.json",
           REQUEUE_RECORD, "agents.json", "roster.json", "discovery.json", "exit",
           "launch-*.json", "job-*.yaml", "report.json", "drain")
"""What belongs to one run (glob patterns in RUN_DIR); everything else stays across runs."""


def say(who: str, msg: str) -> None:
    """One line of a worker's account on stderr, `[who] msg`, whatever the log level (resume's:
    the step it restored, the step it stops at for a requeue; checkpoint/resume.py)."""
    print(f"[{who}] {msg}", file=sys.stderr, flush=True)


def read_requeue_record(run_dir: str | os.PathLike[str]) -> dict | None:
    """RUN_DIR/requeue.json (REQUEUE_RECORD); None: there is none, or it is torn or not an
    object (a file is read as untrusted)."""
    try:
        record = json.loads((Path(run_dir) / REQUEUE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def new_run_id() -> str:
    """A fresh local run id: UTC start time and 4 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def slurm_run_id(job_id: str) -> str:
    return f"slurm-{job_id}"


def attempt() -> int:
    """Which attempt of its run this process belongs to: 0 first, then 1, 2, ... The largest of
    SLURM_RESTART_COUNT (Slurm requeues), OOBLECK_REQUEUE_COUNT (the local requeue role,
    launch/requeue.py) and OOBLECK_RESTART_COUNT (a watchdog restart, the node environment)."""
    values = [os.environ.get(k, "") for k in
              ("SLURM_RESTART_COUNT", "OOBLECK_REQUEUE_COUNT", "OOBLECK_RESTART_COUNT")]
    return max([int(v) for v in values if v.isdigit()], default=0)


def read_run_id(run_dir: str | os.PathLike[str]) -> str:
    """The id of RUN_DIR's current run ('' when none was recorded)."""
    try:
        return (Path(run_dir) / RUN_ID_FILE).read_text().strip()
    except OSError:
        return ""


def run_id(run_dir: str | os.PathLike[str] | None = None) -> str:
    """This process's run: OOBLECK_RUN_ID (set by the launchers for every agent and worker), else
    RUN_DIR's current run (a command from another shell, e.g. kill-node), else ''."""
    return os.environ.get("OOBLECK_RUN_ID") or (read_run_id(run_dir) if run_dir else "")


def umask(group_access: bool = False) -> int:
    """The umask a run's processes create files under (module docstring)."""
    return GROUP_UMASK if group_access else PRIVATE_UMASK


def current_umask() -> int:
    """This process's umask (set to 077 for an instant: what a thread creates meanwhile is only
    more private)."""
    mask = os.umask(PRIVATE_UMASK)
    os.umask(mask)
    return mask


@contextmanager
def private_files(group_access: bool = False) -> Iterator[None]:
    """Within: files and directories this process (and every process it starts) creates are its
    user's alone, or with `group_access` its group's to read too (module docstring); the umask
    before is restored after."""
    before = os.umask(umask(group_access))
    try:
        yield
    finally:
        os.umask(before)


def make_run_dir(run_dir: str | os.PathLike[str], group_access: bool = False) -> Path:
    """RUN_DIR, made if missing, with its mode set: 0700 (0750 with `group_access`) even when an
    earlier run or the default umask made it 0755. Its parents, when made, are private too."""
    run_dir = Path(run_dir)
    with private_files(group_access):
        run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o777 & ~umask(group_access))
    return run_dir


class ForeignFile(PermissionError):
    """A request file that is not the job's user's own (`read_own`): `reason` says why, `key`
    tells this file apart from a later one at the same path (to report each one once)."""

    def __init__(self, path: Path, reason: str, key: tuple):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.key = path, reason, key


def read_own(path: str | os.PathLike[str]) -> str:
    """The text of a request file (drain, grow) that this process's user owns. Raises
    FileNotFoundError when there is none, ForeignFile when it is not a regular file of this
    user (another user's, a link, a FIFO): its content is never read then. The owner is checked
    on the file that is read (one open, no symbolic link followed), so it cannot be swapped
    between the check and the read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        st = os.lstat(path)
        raise ForeignFile(path, "is a symbolic link, not a file",
                          (st.st_ino, st.st_mtime_ns, st.st_uid)) from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        key = (st.st_ino, st.st_mtime_ns, st.st_uid)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignFile(path, "is not a regular file", key)
        if st.st_uid != os.getuid():
            raise ForeignFile(path, f"is owned by uid {st.st_uid}, not by the job's user "
                              f"(uid {os.getuid()})", key)
        return f.read().decode(errors="replace")


def begin(run_dir: str | os.PathLike[str], new_id: str, group_access: bool = False) -> str | None:
    """Make `new_id` RUN_DIR's current run. If another run's records are there, move them to
    RUN_DIR/history/<its id>/ first and return that id; None when there was nothing to move
    (a requeued attempt of the same run keeps its records). A new run gets a new secret
    (RUN_DIR/secret: control/auth.py); a requeued attempt keeps its run's. RUN_DIR and what
    this writes are private (`make_run_dir`, `private_files`)."""
    run_dir = make_run_dir(run_dir, group_access)
    with private_files(group_access):
        return _begin(run_dir, new_id)


def _begin(run_dir: Path, new_id: str) -> str | None:
    from oobleck_hpc.control.auth import write_secret

    old = read_run_id(run_dir)
    write_secret(run_dir, fresh=old != new_id)
    if old == new_id:
        return None
    present = sorted({p for pattern in PER_RUN for p in run_dir.glob(pattern)})
    moved = None
    if present:
        # Records written before run ids existed: named by the time of their last change.
        moved = old or "unnamed-" + time.strftime(
            "%Y%m%d-%H%M%S", time.gmtime(max(p.stat().st_mtime for p in present)))
        dest = run_dir / HISTORY / moved
        while dest.exists():
            dest = dest.with_name(dest.name + "+")
        dest.mkdir(parents=True)
        for p in present:
            os.replace(p, dest / p.name)
        _prune(run_dir / HISTORY, KEEP_RUNS)
    write_atomic(run_dir / RUN_ID_FILE, new_id + "\n")
    return moved


def write_job(run_dir: str | os.PathLike[str], job, by: str) -> Path:
    """RUN_DIR/job.yaml: the job as loaded (overrides applied, run_dir absolute) -- what Slurm's
    agents read, and what `oobleck-hpc export` and `grow` find for any run. `by`: the command."""
    import yaml

    data = json.loads(json.dumps(job.to_dict()))  # tuples -> lists
    data["run_dir"] = str(Path(run_dir).absolute())
    path = Path(run_dir) / "job.yaml"
    write_atomic(path, f"# Written by oobleck-hpc {by} from {job.source}\n"
                 + yaml.safe_dump(data, sort_keys=False))
    return path


def history(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The directories of RUN_DIR's earlier runs, oldest first."""
    root = Path(run_dir) / HISTORY
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)


def _prune(root: Path, keep: int) -> None:
    runs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in runs[:max(0, len(runs) - keep)]:
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------- the verdict

@dataclass(frozen=True)
class Outcome:
    """How a run ended, from its record (`outcome`)."""

    run: str
    finished: bool
    """The last step is committed: the run's `run_finished` event for every step of the job."""
    last_step: int
    """The highest step the run committed (its metrics file; else its `run_finished` event)."""
    total: int
    """The steps the job trains (0: not recorded)."""
    committed: int
    """Distinct steps in the metrics file (a step replayed after a fallback counts once)."""

    def describe(self) -> str:
        """'finished at step 60 of 60' or 'ended at step 679 of 1500: not finished'."""
        of = f" of {self.total}" if self.total else ""
        if self.finished:
            return f"finished at step {self.last_step}{of}"
        return f"ended at step {self.last_step}{of}: not finished"


def is_finished_event(event: Mapping, run: str) -> bool:
    """`event` is the `run_finished` event of run `run` ('' matches any run) for every step."""
    return (event.get("kind") == "run_finished" and (not run or event.get("run") == run)
            and int(event.get("steps") or 0) >= int(event.get("total") or 0))


def outcome(run_dir: str | os.PathLike[str], run: str | None = None,
            metrics: str | os.PathLike[str] | None = None) -> Outcome:
    """The verdict of RUN_DIR's run `run` (default: its current one) from its records: its
    events (RUN_DIR/events.jsonl) and its metrics (`metrics`, default RUN_DIR/metrics.jsonl).
    Finished means a `run_finished` event of this run for all of the job's steps, and, when the
    metrics file holds this run's steps, the last of them among them."""
    run_dir = Path(run_dir)
    run = read_run_id(run_dir) if run is None else run
    total, finished_at = 0, None
    for e in read_jsonl(run_dir / "events.jsonl"):
        if run and e.get("run") != run:
            continue
        if e.get("kind") == "run_started" and e.get("steps"):
            total = int(e["steps"])
        elif is_finished_event(e, run):
            finished_at = int(e.get("steps") or 0)
            total = int(e.get("total") or total or finished_at)
    steps = {int(r["step"]) for r in read_jsonl(metrics or run_dir / "metrics.jsonl")
             if (not run or r.get("run") == run) and isinstance(r.get("step"), int)}
    last = max(steps, default=finished_at or 0)
    finished = finished_at is not None and (not steps or (total or finished_at) in steps)
    return Outcome(run, finished, last, total, len(steps))


def verdict(finished: bool, codes: Iterable[int]) -> int:
    """The job's exit code: 0 if the run finished (`outcome`); else 2 if any node reported bad
    input; else 75 (requeue: a checkpoint is on disk) if any node asked for one; else 3. `codes`:
    the agents' exit codes (a node whose agent recorded none, killed with it, is absent). A node
    that exited 0 without the run finishing (drained, left early) only says how it ended."""
    codes = set(codes)
    if finished:
        return EXIT_OK
    if EXIT_BAD_INPUT in codes:
        return EXIT_BAD_INPUT
    if EXIT_REQUEUE in codes:
        return EXIT_REQUEUE
    return EXIT_UNRECOVERABLE


def read_jsonl(path: str | os.PathLike[str]) -> list[dict]:
    """The JSON objects of one file of JSON lines (events, per-step metrics) in file order; []
    when the file does not exist (yet). A torn line (a writer killed, or still writing) is
    skipped."""
    rows = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except FileNotFoundError:
        return []
    return rows
