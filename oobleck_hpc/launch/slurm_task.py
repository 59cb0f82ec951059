"""The wrapper around each node's agent in a Slurm job: `python -m oobleck_hpc.launch.slurm_task
--run-dir DIR --tag JOB-rK -- AGENT...` (stdlib only; started by srun, one per node).

1. Runs the agent and records its exit code in DIR/exit/TAG/NODE: `srun` reports only the highest
   code of a step, and the code of a node that Slurm fenced (dropped from the job, then killed)
   must not count, so the verdict is taken per node over the nodes still in the job (`verdict`).
2. Survives the pre-timeout signal and SIGTERM itself (no-op handlers): Slurm signals every
   process of a task, so the agent gets them directly; the wrapper only waits for it.
3. Finishes the job when the batch script is gone. Measured on Slurm 22.05 with `--no-kill`: when
   the node running the batch script dies, the job does NOT end and is NOT requeued; the agents on
   the other nodes keep running (to them it is one more node loss), and once they exit the job
   would sit RUNNING, without a driver, until its time limit. So after its agent exits, the
   wrapper asks the controller whether the batch host is still in the job; if not, and every
   surviving node has recorded its exit code, it takes the verdict itself: 75 -> `scontrol
   requeue` (resume from the checkpoint), else `scancel` (sacct then shows CANCELLED; the truth
   is in DIR/launch-TAG.json, written by this wrapper with finished_by=NODE).
4. Points the training's per-step metrics at DIR/metrics.jsonl (OOBLECK_METRICS, unless the
   environment already names a file), as `oobleck-hpc run` does for a local job: the current
   plan's rank 0 appends one JSON line per committed step, on whichever node it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_OK = 0
EXIT_REQUEUE = 75  # oobleck_hpc.errors.EXIT_REQUEUE (kept import-free: this wraps every agent)


def verdict(roster: list[str], lost: list[str], codes: dict[str, int]) -> int:
    """The job's outcome from its agents' exit codes, counting only nodes still in the job.

    Nodes the controller dropped (dead or hung, then fenced by Slurm) are ignored: the survivors
    carried on without them. Among the rest: any agent asking for a requeue (75) -> 75; else any
    agent that finished (0) -> 0, because an elastic job finishes on its final membership and an
    agent that exited 3 had its node failed or fenced by the others along the way (the agents'
    exit convention, oobleck_hpc/agent.py); else the first failure (1 when none was recorded).
    """
    survivors = [n for n in roster if n not in lost]
    mine = [codes.get(n) for n in survivors]
    if EXIT_REQUEUE in mine:
        return EXIT_REQUEUE
    if EXIT_OK in mine:
        return EXIT_OK
    return next((c for c in mine if c is not None), 1)


def read_codes(exit_dir: Path) -> dict[str, int]:
    codes = {}
    for path in exit_dir.iterdir():
        if not path.name.startswith("."):
            try:
                codes[path.name] = int(path.read_text().strip())
            except ValueError:
                codes[path.name] = 1
    return codes


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=60).stdout
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", out))


def _hostnames(hostlist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True,
                         text=True, timeout=60).stdout
    return out.split()


def _slurmd_alive(node: str, timeout_s: float = 2.0) -> bool:
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
    """If the batch host left the job and every survivor has exited, end the job (module doc)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return
    fields = _job_fields(job_id)
    current = _hostnames(fields.get("NodeList", "")) if fields.get("NodeList") else []
    exit_dir = run_dir / "exit" / tag
    codes = read_codes(exit_dir)
    # The controller drops a dead node only after SlurmdTimeout (~10 s here), and agents that
    # fall back (exit 75) right after a node loss are faster: a node whose slurmd refuses
    # connections is dead already, batch host included (else nobody would requeue the job).
    current = [n for n in current if n in codes or _slurmd_alive(n)]
    if fields.get("BatchHost") in current or not current:
        return  # the driver lives: it takes the verdict
    if any(n not in codes for n in current):
        return  # another survivor is still running; the last one finishes
    roster = json.loads((run_dir / "roster.json").read_text())
    names = [n["name"] for n in roster["nodes"]]
    lost = [n for n in names if n not in current]
    rc = verdict(names, lost, codes)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    _write_atomic(run_dir / f"launch-{tag}.json", json.dumps({
        "job_id": job_id, "restart_count": restart, "nodes": names, "lost_nodes": lost,
        "exit_code": rc, "codes": codes, "batch_host_lost": fields.get("BatchHost"),
        "finished_by": node, "time": time.time()}, indent=1) + "\n")
    print(f"slurm_task {node}: batch host {fields.get('BatchHost')} is gone; survivors "
          f"{current} exited {codes}: verdict {rc}", flush=True)
    if rc == EXIT_REQUEUE:
        subprocess.run(["scontrol", "requeue", job_id], timeout=60)
    else:
        subprocess.run(["scancel", job_id], timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_hpc.launch.slurm_task",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tag", required=True, help="JOBID-rRESTART")
    parser.add_argument("agent", nargs=argparse.REMAINDER, help="-- AGENT COMMAND...")
    args = parser.parse_args(argv)
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    if not agent:
        parser.error("give the agent command after --")
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    run_dir = Path(args.run_dir)
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
    _write_atomic(exit_dir / node, f"{rc}\n")
    try:
        finish_without_driver(run_dir, args.tag, node)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
        print(f"slurm_task {node}: could not check the batch host ({e})", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
