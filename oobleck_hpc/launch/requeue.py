"""The local launcher's requeue role: start the job again when it exits 75, a bounded number of times.

Under Slurm a job that exits with errors.EXIT_REQUEUE (75: the guarantee was exceeded, or a
pre-timeout / preemption signal arrived, and a checkpoint is on disk) is requeued by the launch
driver (`scontrol requeue`, launch/slurm_driver.py) and comes back with the nodes Slurm gives
it. On one machine `oobleck-hpc run` plays that role with `run_with_requeue`:

    code = run_with_requeue(lambda attempt, nodes: launch(...), nodes=job.cluster.nodes,
                            run_dir=run_dir, max_requeues=3)

- attempt k runs with OOBLECK_REQUEUE_COUNT = base + k (the analogue of SLURM_RESTART_COUNT; base
  is the OOBLECK_RESTART_COUNT a watchdog restart set, else 0) and OOBLECK_ATTEMPT = "<base attempt>.r<k>", which
  names the attempt's temporary checkpoint directories (checkpoint/writer.py) so that leftovers of an
  attempt never mix into the next one's checkpoints;
- exit 75: the job's rank 0 left RUN_DIR/requeue.json (checkpoint/resume.py) naming the nodes still alive
  when it knew them (the guarantee was exceeded because nodes died); the next attempt starts on
  that many nodes -- "the nodes it has" -- and otherwise on as many as before. It plans for them
  and resumes from the latest checkpoint (checkpoint/resume.py), so the restart is as on Slurm;
- any other code ends the loop (0 done, 2 bad input, 3 unrecoverable: never requeued), and so
  does a 75 after a stop signal reached the launcher itself (Ctrl-C, `kill PID`: whoever sent it
  asked the job to stop, not to start again; running it again resumes from its checkpoint);
- after `max_requeues` requeues the loop gives up and returns 75 (the watchdog, if one watches,
  may still restart the job from its checkpoint).

Records: every attempt appends to the run's metrics file (each line names its attempt: a step
replayed after a fallback appears once per attempt that ran it) and events file (with `events`,
the loop adds a `requeued` event per requeue); the per-node logs of a requeued attempt
(RUN_DIR/logs) are kept as RUN_DIR/logs-attempt<k> (oobleck_hpc/records/runs.py: the run directory).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oobleck_hpc.records import runs
from oobleck_hpc.records import events as ev
from oobleck_hpc.errors import EXIT_REQUEUE

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    index: int
    """0 for the first run of this launch, then 1, 2, ..."""
    nodes: int
    """Nodes to start this attempt on."""
    code: int | None = None
    stopped: bool = False
    """A stop signal reached the launcher during the attempt (module docstring)."""
    seconds: float = 0.0
    reason: str = ""


def run_with_requeue(launch: Callable[[Attempt], int], *, nodes: int, run_dir: str | Path,
                     max_requeues: int = 3,
                     min_nodes: int = 1, events=None) -> tuple[int, list[Attempt]]:
    """Run `launch(attempt)` until it returns something other than 75, at most
    `max_requeues` + 1 times. Returns (the last exit code, the attempts). A requeue runs on
    the nodes left alive, but never on fewer than `min_nodes` (the fewest the job's plan
    accepts, (f + 1) * n0: below it the planner would refuse the job -- as a requeued Slurm job
    gets the nodes it asks for, a local one gets that many pretend nodes). `events`: the run's
    EventLog, for a `requeued` event per requeue (instead of a line logged)."""
    if max_requeues < 0:
        raise ValueError(f"max_requeues={max_requeues}: use 0 to never requeue")
    run_dir = Path(run_dir)
    base_attempt = os.environ.get("OOBLECK_ATTEMPT") or f"local{os.getpid()}"
    base_restarts = int(os.environ.get("OOBLECK_RESTART_COUNT", "0") or 0)
    attempts: list[Attempt] = []
    saved = {k: os.environ.get(k) for k in ("OOBLECK_ATTEMPT", "OOBLECK_REQUEUE_COUNT")}
    try:
        for index in range(max_requeues + 1):
            attempt = Attempt(index, nodes)
            attempts.append(attempt)
            os.environ["OOBLECK_ATTEMPT"] = f"{base_attempt}.r{index}"
            os.environ["OOBLECK_REQUEUE_COUNT"] = str(base_restarts + index)
            (run_dir / runs.REQUEUE_RECORD).unlink(missing_ok=True)
            t0 = time.monotonic()
            try:
                attempt.code = launch(attempt)
            finally:
                attempt.seconds = time.monotonic() - t0
            if attempt.code != EXIT_REQUEUE:
                return attempt.code, attempts
            if attempt.stopped:
                logger.warning("stopped by a signal: not requeued; run the job again to resume "
                               "from its latest checkpoint")
                return attempt.code, attempts
            if (run_dir / "logs").is_dir():  # the next attempt's agents start new logs
                kept = run_dir / f"logs-attempt{index}"
                shutil.rmtree(kept, ignore_errors=True)  # an earlier launch's
                os.replace(run_dir / "logs", kept)
            record = runs.read_requeue_record(run_dir) or {}
            attempt.reason = str(record.get("reason") or "exit 75")
            alive = record.get("nodes")
            if alive:
                nodes = max(len(alive), min_nodes)
            if index == max_requeues:
                break
            if events is None:
                logger.info("attempt %d exited 75 after %.1f s (%s); requeue %d/%d on %d nodes%s",
                            index, attempt.seconds, attempt.reason, index + 1, max_requeues,
                            nodes, f" (alive: {', '.join(alive)})" if alive else "")
            else:  # the console tells it (oobleck_hpc/records/story.py)
                events.emit(ev.REQUEUED, next_attempt=base_restarts + index + 1, nodes=nodes,
                            alive=alive, reason=attempt.reason[:300],
                            seconds=round(attempt.seconds, 3))
        logger.warning("giving up after %d requeues (last: %s); the latest checkpoint stays on "
                       "disk -- run the job again to resume from it", max_requeues,
                       attempts[-1].reason)
        return EXIT_REQUEUE, attempts
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
