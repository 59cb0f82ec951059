"""Node loss under a real Slurm controller: how fast the survivors agree, and how fast Slurm notices.

Needs the local cluster (slurm/dev-cluster.sh up; SLURM_CONF exported). Per repeat: submit a
4-node job whose per-node program is the real agent (oobleck_hpc.control.agent) with 2 echo workers per
node, wait until all 8 workers hold generation 0, `dev-cluster.sh kill-node n3`, then measure

- submit_to_gen0_s      submission -> every worker has the generation-0 membership
- discovery_s           the MPI discovery step (LaunchResult.discovery_s)
- kill_to_agreed_s      SIGKILL -> the last survivor's agreement on generation 1 (events.jsonl)
- kill_to_workers_s     SIGKILL -> every surviving worker has generation 1 (seen by this script,
                        polling every 10 ms)
- kill_to_slurm_drop_s  SIGKILL -> `scontrol show job` no longer lists n3 (SlurmdTimeout=5)

then stops the workers and checks the job finished with the same id and n3 lost.

    slurm/dev-cluster.sh up && eval "$(slurm/dev-cluster.sh env)"
    python bench/slurm.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "slurm" / "dev-cluster.sh"
NODES = ["n1", "n2", "n3", "n4"]
VICTIM = "n3"


def _has_gen(run_dir: Path, worker: str, gen: int) -> bool:
    path = run_dir / "workers" / f"{worker}.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("kind") == "membership" and row.get("gen") == gen:
            return True
    return False


def _wait(predicate, timeout: float, what: str, every: float = 0.01) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
    return time.time()


def one_run(base: Path, index: int) -> dict:
    from oobleck_hpc.bootstrap import current_job_nodes
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch import submit

    subprocess.run([str(DEV), "up"], check=True, capture_output=True, timeout=120)
    run_dir = base / f"run{index}"
    job_file = base / f"job{index}.yaml"
    job_file.write_text(yaml.safe_dump({
        "name": f"bench-slurm-{index}", "run_dir": str(run_dir),
        "cluster": {"launch": "slurm", "nodes": 4, "gpus_per_node": 2, "device": "cpu"},
        "fault_tolerance": {"heartbeat_s": 0.5, "lease_s": 3.0},
        "slurm": {"time_min": 5, "agent_command": "{python} -m oobleck_hpc.control.agent --job {job} "
                  "--run-dir {run_dir} -- {python} -m oobleck_hpc.testing.echo_worker"},
    }))
    workers = [f"{n}.{r}" for n in NODES for r in (0, 1)]
    survivors = [w for w in workers if not w.startswith(VICTIM + ".")]
    t_submit = time.time()
    job = submit(load_job(job_file))
    t_gen0 = _wait(lambda: all(_has_gen(run_dir, w, 0) for w in workers), 120, "generation 0")
    out = subprocess.run([str(DEV), "kill-node", VICTIM], capture_output=True, text=True,
                         check=True).stderr
    t_kill = float(out.split(" at ")[1].split(":")[0])  # taken just before the SIGKILL
    t_workers = _wait(lambda: all(_has_gen(run_dir, w, 1) for w in survivors), 60, "generation 1")
    agreed = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if '"agreement_reached"' in line]
    t_agreed = max(e["t"] for e in agreed if e["gen"] == 1)
    t_drop = _wait(lambda: VICTIM not in current_job_nodes(job.job_id), 60, "Slurm to drop the node",
                   every=0.2)
    (run_dir / "ctl").mkdir(exist_ok=True)
    (run_dir / "ctl" / "STOP").touch()
    result = job.result()
    if result.lost_nodes != [VICTIM] or result.exit_code != 0 or result.job_id != job.job_id:
        raise RuntimeError(f"unexpected outcome: {result}")
    return {"submit_to_gen0_s": t_gen0 - t_submit, "discovery_s": result.discovery_s,
            "kill_to_agreed_s": t_agreed - t_kill, "kill_to_workers_s": t_workers - t_kill,
            "kill_to_slurm_drop_s": t_drop - t_kill}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        for i in range(args.repeats):
            runs.append(one_run(Path(tmp), i))
            if not args.json:
                print(f"run {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()),
                      flush=True)
    subprocess.run([str(DEV), "up"], check=True, capture_output=True, timeout=120)
    summary = {k: {"median": statistics.median(r[k] for r in runs),
                   "max": max(r[k] for r in runs)} for k in runs[0]}
    if args.json:
        print(json.dumps({"repeats": args.repeats, "runs": runs, "summary": summary}, indent=1))
    else:
        for k, v in summary.items():
            print(f"{k:22s} median {v['median']:.3f}  max {v['max']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
