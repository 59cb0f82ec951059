"""Run records: which run and which attempt wrote a record, and where each run's records live.

A *run* is one launch of a job: one `oobleck-hpc run` (with its local requeues and watchdog
restarts), or one Slurm job (with all its requeues: the same job id). Its id is
`YYYYmmdd-HHMMSS-xxxx` (local, UTC) or `slurm-JOBID`. An *attempt* is one start of the run's
processes: 0 first, then one more per requeue or restart (`attempt()`).

Every event (`elastic/events.py`) and every metrics line carries both (`run`, `attempt`), and a
run directory only ever holds ONE run's records: when a new run starts, the launcher
(`begin`) moves the previous run's records into RUN_DIR/history/<its run id>/. The layout:

    RUN_DIR/                     (the job's run_dir; default runs/<job name>)
      run-id                     the current run's id
      events.jsonl               every transition of the run, each with t, kind, source, run, attempt
      metrics.jsonl              one line per committed step (step 1..N), each with run, attempt
      logs/                      this attempt's per-node agent logs (logs-attempt<k>/: earlier ones)
      final/                     final parameters (train.save_final_params)
      exit.json  requeue.json  agents.json  roster.json  exit/  launch-*.json   (launchers)
      drain/                     drain requests (elastic/drain.py: oobleck-hpc drain)
      run.json  heartbeat  job.lock  job.yaml  submitit/   (kept across runs: watch, submit)
      history/<run id>/          an earlier run's records, same names (the last KEEP_RUNS runs)

Stdlib only: the Slurm wrapper (launch/slurm_task.py) and the event log import it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

from oobleck_hpc.files import write_atomic

RUN_ID_FILE = "run-id"
HISTORY = "history"
KEEP_RUNS = 20
"""Earlier runs kept under RUN_DIR/history (the oldest go first)."""
PER_RUN = ("events.jsonl", "metrics.jsonl", "logs", "logs-attempt*", "final", "exit.json",
           "requeue.json", "agents.json", "roster.json", "discovery.json", "exit",
           "launch-*.json", "job-*.yaml", "report.json", "drain")
"""What belongs to one run (glob patterns in RUN_DIR); everything else stays across runs."""


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


def begin(run_dir: str | os.PathLike[str], new_id: str) -> str | None:
    """Make `new_id` RUN_DIR's current run. If another run's records are there, move them to
    RUN_DIR/history/<its id>/ first and return that id; None when there was nothing to move
    (a requeued attempt of the same run keeps its records)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    old = read_run_id(run_dir)
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
