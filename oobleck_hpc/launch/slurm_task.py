"""The wrapper around each node's agent in a Slurm job: `python -m oobleck_hpc.launch.slurm_task
--run-dir DIR --tag JOB-rK -- AGENT...` (stdlib only; started by srun, one per node).
For slurm/train.sbatch: `... --run-dir DIR --tag JOB-rK --begin` makes the job RUN_DIR's current
run (`begin_run`); `--recorded` prints the exit code recorded for this run to publish
(`recorded_outcome`), or nothing; `--verdict` prints the verdict of this attempt (`run_verdict`:
the run's record says whether it finished, oobleck_hpc/records/runs.py).

1. Runs the agent and records its exit code in DIR/exit/TAG/NODE: `srun` reports only the highest
   code of a step, and an unfinished run's outcome (requeue, bad input, failed) is a rule over
   every node's code (`run_verdict`).
2. Survives the pre-timeout signal and SIGTERM itself (no-op handlers): Slurm signals every
   process of a task, so the agent gets them directly; the wrapper only waits for it.
3. Finishes the job when the batch script is gone. Measured on Slurm 22.05 with `--no-kill`: when
   the node running the batch script dies, the job does NOT end and is NOT requeued; the agents on
   the other nodes keep running (to them it is one more node loss), and once they exit the job
   would sit RUNNING, without a driver, until its time limit. So after its agent exits, the
   wrapper asks the controller whether the batch host is still in the job; if not, and every
   surviving node has recorded its exit code, it takes the verdict itself, writes it to
   DIR/launch-TAG.json (finished_by=NODE) and requeues the job (`scontrol requeue`): for 75 the
   next run resumes from the checkpoint; for any other verdict the next run only publishes the
   recorded outcome (`recorded_outcome`; the driver returns it, slurm/train.sbatch exits with it)
   and asks for one node (`requeue`). A new batch script is the only way a
   user can end a Slurm job with its real exit code: `scancel` shows CANCELLED (an `afterok`
   dependency never fires), and 22.05 has no command that completes a job. Measured on the local
   cluster: RESIZING, then COMPLETED with ExitCode 0:0, the requeued run over in ~1 s once started.
4. Requeues on the nodes left (`requeue`, also for the drivers: `--requeue`): Slurm brings a
   requeued job back with its original node count, so with a node DOWN it would wait for it. A
   job that resumes (75) asks instead for the nodes that are left (those whose agent recorded an
   exit code this run) when at least OOBLECK_MIN_NODES (the fewest its plan accepts; exported by
   the batch script) are; else for its original count, and waits. Slurm takes a new node count
   only once the job is PENDING (measured), when the requeueing run is gone: a detached helper
   (double fork, outside the step's process tree) waits for that and runs `scontrol update
   JobId=J NumNodes=K NumTasks=K`. Best effort: where Slurm tracks the job's processes by cgroup
   it dies with the step, and the job asks for all its nodes.
5. Points the training's per-step metrics at DIR/metrics.jsonl (OOBLECK_METRICS, unless the
   environment already names a file), as `oobleck-hpc run` does for a local job: the current
   plan's rank 0 appends one JSON line per committed step, on whichever node it runs.
6. Run records (oobleck_hpc/records/runs.py): a Slurm job is one run, `slurm-JOBID`, its requeues are
   its attempts (SLURM_RESTART_COUNT). `begin_run` (the drivers, before anything starts) moves
   an earlier run's records to DIR/history/ and exports OOBLECK_RUN_ID to the job's steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from oobleck_hpc.records import runs
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.errors import EXIT_REQUEUE
from oobleck_hpc.files import write_atomic, write_json
from oobleck_hpc.diagnostics import configure
from oobleck_hpc.polling import wait_until

logger = logging.getLogger(__name__)


def run_verdict(run_dir: Path, tag: str) -> tuple[int, dict[str, int], runs.Outcome]:
    """(verdict, exit codes, outcome) of the run's attempt `tag`: the run's record decides
    whether it finished (`runs.outcome`, the one rule of every launcher); the agents' codes
    only whether an unfinished run asks for a requeue, stops for bad input or failed
    (`runs.verdict`)."""
    codes = read_codes(run_dir / "exit" / tag)
    out = runs.outcome(run_dir)
    return runs.verdict(out.finished, codes.values()), codes, out


def recorded_outcome(run_dir: Path, job_id: str, restart: int) -> dict | None:
    """The outcome the previous run of this job recorded when it ended without its batch script
    (`finish_without_driver`), unless it asked to resume (75): then this run only publishes it."""
    if restart < 1:
        return None
    try:
        outcome = json.loads((run_dir / f"launch-{job_id}-r{restart - 1}.json").read_text())
    except (OSError, ValueError):
        return None
    if "finished_by" not in outcome or outcome.get("exit_code") == EXIT_REQUEUE:
        return None
    return outcome


def read_codes(exit_dir: Path) -> dict[str, int]:
    codes = {}
    for path in exit_dir.iterdir():
        if not path.name.startswith("."):
            try:
                codes[path.name] = int(path.read_text().strip())
            except ValueError:
                codes[path.name] = 1
    return codes


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=60).stdout
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", out))


def _hostnames(hostlist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True,
                         text=True, timeout=60).stdout
    return out.split()


def slurmd_alive(node: str, timeout_s: float = 2.0) -> bool:
    """Whether `node`'s slurmd accepts a TCP connection (NodeAddr and Port from scontrol; True
    when they are unknown: then the controller's view stands)."""
    import socket

    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                         timeout=60).stdout
    fields = dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", out))
    addr, port = fields.get("NodeAddr"), fields.get("Port", "")
    if not addr or not port.isdigit():
        return True
    try:
        socket.create_connection((addr, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def finish_without_driver(run_dir: Path, tag: str, node: str) -> None:
    """If the batch host left the job and every survivor has exited, take the verdict and requeue
    the job, to resume (75) or to end with the verdict (module docstring, point 3)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return
    fields = job_fields(job_id)
    current = _hostnames(fields.get("NodeList", "")) if fields.get("NodeList") else []
    codes = read_codes(run_dir / "exit" / tag)
    # The controller drops a dead node only after SlurmdTimeout (~10 s here), and agents that
    # fall back (exit 75) right after a node loss are faster: a node whose slurmd refuses
    # connections is dead already, batch host included (else nobody would requeue the job).
    current = [n for n in current if n in codes or slurmd_alive(n)]
    if fields.get("BatchHost") in current or not current:
        return  # the driver lives: it takes the verdict
    if any(n not in codes for n in current):
        return  # another survivor is still running; the last one finishes
    names = roster_names(run_dir)
    lost = [n for n in names if n not in current]
    rc, codes, out = run_verdict(run_dir, tag)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    write_json(run_dir / f"launch-{tag}.json", {
        "job_id": job_id, "restart_count": restart, "nodes": names, "lost_nodes": lost,
        "exit_code": rc, "codes": codes, "outcome": out.describe(),
        "batch_host_lost": fields.get("BatchHost"), "finished_by": node,
        "time": time.time()})
    end_replacements(run_dir, f"the job's run ended with exit {rc} (its batch host was lost)")
    print(f"slurm_task {node}: batch host {fields.get('BatchHost')} is gone; survivors "
          f"{current} exited {codes}; the run {out.describe()}: verdict {rc}; requeueing the job to "
          f"{'resume' if rc == EXIT_REQUEUE else 'end with it'}", flush=True)
    # One node is enough to publish the outcome (the lost batch host may never come back).
    requeue(job_id, run_dir, tag, 1 if rc != EXIT_REQUEUE else nodes_left(names, codes),
            "" if rc == EXIT_REQUEUE else f"to publish the outcome (exit {rc}) of a run that "
            f"lost its batch host {fields.get('BatchHost')}")


def begin_run(run_dir: Path, job_id: str, restart: int, group_access: bool = False) -> str:
    """Make job `job_id` RUN_DIR's current run (`runs.begin`: an earlier run's records move to
    history/; RUN_DIR 0700, or 0750 with the job's `group_access`) and name it in OOBLECK_RUN_ID
    for the steps this process starts; the first attempt records `run_started`. Returns the run
    id."""
    run_id = runs.slurm_run_id(job_id)
    runs.begin(run_dir, run_id, group_access)
    os.environ["OOBLECK_RUN_ID"] = run_id
    if restart == 0:
        EventLog(run_dir / "events.jsonl", source="driver").emit(
            "run_started", launch="slurm", job_id=job_id,
            nodes=len(_hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))))
    return run_id


def nodes_left(roster: list[str], codes: dict[str, int], least: int | None = None) -> int | None:
    """How many nodes a job that resumes asks for (module docstring, point 4): the run's nodes
    (`roster`) whose agent recorded an exit code, when at least `least` (default:
    OOBLECK_MIN_NODES) are and some were lost; None (the original count) otherwise."""
    left = sum(n in codes for n in roster)
    if least is None:
        least = int(os.environ.get("OOBLECK_MIN_NODES") or 1)
    return left if least <= left < len(roster) else None


def roster_names(run_dir: Path) -> list[str]:
    """The nodes of the current run: its discovery's (RUN_DIR/discovery.json; roster.json also
    lists the nodes of replacement jobs that joined, which are not this job's)."""
    return [r["node"] for r in json.loads((run_dir / "discovery.json").read_text())["records"]]


REPLACEMENTS_DIR = "replacements"
"""RUN_DIR/replacements/JOBID.json: one record per replacement job submitted (launch/slurm.py)."""


def end_replacements(run_dir: Path, why: str, grace_s: float = 15.0) -> list[str]:
    """The job ends or is requeued: its replacement jobs end with it (no orphaned jobs). A
    replacement whose agents joined ends by itself with the job's agents (given `grace_s`);
    every replacement recorded in RUN_DIR/replacements/ still pending or running after that is
    cancelled (`scancel`). Records a `replacements_ended` event, removes the records; returns
    the job ids cancelled."""
    records = sorted((run_dir / REPLACEMENTS_DIR).glob("*.json"))
    active = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED")
    deadline = time.monotonic() + grace_s
    cancelled = []
    for record in records:
        job_id = record.stem
        state = job_fields(job_id).get("JobState", "")
        while state in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
            time.sleep(0.5)
            state = job_fields(job_id).get("JobState", "")
        if state in active:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
            cancelled.append(job_id)
        record.unlink(missing_ok=True)
    if cancelled:
        EventLog(run_dir / "events.jsonl", source="driver").emit(
            "replacements_ended", job_ids=cancelled, why=why)
    return cancelled


def requeue(job_id: str, run_dir: Path, tag: str, nodes: int | None, reason: str = "") -> None:
    """`scontrol requeue JOB`; with `nodes`, first a detached helper that makes the requeued job
    ask for that many nodes once it is PENDING (`shrink_when_pending`). Records a `requeued`
    event (its reason: RUN_DIR/requeue.json's, else `reason`)."""
    restart = int(tag.rpartition("-r")[2] or 0)
    record = runs.read_requeue_record(run_dir) or {}
    if record.get("restart_count") != restart or reason:
        record = {}  # an earlier attempt's, or the caller knows better
    EventLog(run_dir / "events.jsonl", source="driver").emit(
        "requeued", next_attempt=restart + 1, nodes=nodes, alive=record.get("nodes"),
        reason=str(record.get("reason") or reason or "exit 75")[:300])
    if nodes is not None:
        subprocess.run(["sh", "-c", '"$0" -m oobleck_hpc.launch.slurm_task --run-dir "$1" '
                        '--tag "$2" --shrink-when-pending "$3" >/dev/null 2>&1 </dev/null &',
                        sys.executable, str(run_dir), tag, str(nodes)], timeout=30)
    logger.info("slurm_task: requeueing job %s%s", job_id,
                f" on {nodes} node(s)" if nodes is not None else "")
    done = subprocess.run(["scontrol", "requeue", job_id], timeout=60)
    # The requeue ends this run at once: Slurm's SIGTERM to the batch step can reach scontrol
    # itself before it exits (seen in a fresh-clone .ci/run: the driver took it for a failed
    # requeue, and submitit recorded the run as failed). Any other failure is one.
    if done.returncode not in (0, -signal.SIGTERM):
        raise subprocess.CalledProcessError(done.returncode, done.args)


def shrink_when_pending(job_id: str, nodes: int, timeout_s: float = 300.0) -> bool:
    """Wait until the requeued job `job_id` is PENDING, then make it ask for `nodes` nodes.
    True when the update was taken."""
    try:
        wait_until(lambda: job_fields(job_id).get("JobState") == "PENDING", timeout_s,
                   f"job {job_id} to be pending", every_s=0.5)
    except TimeoutError:
        return False
    done = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={nodes}",
                           f"NumTasks={nodes}"], capture_output=True, timeout=60)
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_hpc.launch.slurm_task",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tag", required=True, help="JOBID-rRESTART")
    parser.add_argument("--begin", action="store_true",
                        help="make this job the run directory's current run (prints its id); "
                             "RUN_DIR 0750 under umask 027 (group_access), else 0700")
    parser.add_argument("--recorded", action="store_true",
                        help="print the exit code recorded for this run to publish, if any")
    parser.add_argument("--verdict", action="store_true",
                        help="print this attempt's verdict (0 only if the run finished)")
    parser.add_argument("--shrink-when-pending", type=int, default=None, metavar="K",
                        help="(internal) once the requeued job is pending, ask for K nodes")
    parser.add_argument("--requeue", action="store_true",
                        help="requeue the job, on the nodes left when a node was lost (the "
                             "drivers' exit 75)")
    parser.add_argument("agent", nargs=argparse.REMAINDER, help="-- AGENT COMMAND...")
    args = parser.parse_args(argv)
    configure("INFO")  # as its agent (OOBLECK_LOG_LEVEL, from the CLI, else INFO)
    run_dir = Path(args.run_dir)
    job_id = args.tag.rpartition("-r")[0]
    if args.shrink_when_pending is not None:
        return 0 if shrink_when_pending(job_id, args.shrink_when_pending) else 1
    if args.begin:
        # (the batch script runs under the job's umask: `bootstrap umask JOB`, 027 for a team)
        print(begin_run(run_dir, job_id, int(args.tag.rpartition("-r")[2]),
                        group_access=runs.current_umask() == runs.GROUP_UMASK))
        return 0
    if args.requeue:
        requeue(job_id, run_dir, args.tag,
                nodes_left(roster_names(run_dir), read_codes(run_dir / "exit" / args.tag)))
        return 0
    if args.recorded:
        job_id, _, restart = args.tag.rpartition("-r")
        outcome = recorded_outcome(run_dir, job_id, int(restart))
        if outcome is not None:
            print(outcome["exit_code"])
        return 0
    if args.verdict:
        rc, codes, out = run_verdict(run_dir, args.tag)
        print(f"oobleck: agents exited {codes}; the run {out.describe()}", file=sys.stderr)
        print(rc)
        return 0
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not agent:
        parser.error("give the agent command after --")
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    exit_dir = run_dir / "exit" / args.tag
    exit_dir.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the agent got it too (same task)
    env = dict(os.environ)
    env.setdefault("OOBLECK_METRICS", str(run_dir / "metrics.jsonl"))
    child = subprocess.Popen(agent, env=env)
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    rc = 128 - rc if rc < 0 else rc
    write_atomic(exit_dir / node, f"{rc}\n")
    try:
        finish_without_driver(run_dir, args.tag, node)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
        logger.warning("slurm_task %s: could not check the batch host (%s)", node, e)
    return rc


if __name__ == "__main__":
    sys.exit(main())
