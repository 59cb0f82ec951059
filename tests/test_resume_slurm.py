"""Checkpoint + requeue + exact resume under a real Slurm controller (slurm/dev-cluster.sh).

A real training job (gpt-tiny, 4 nodes x 1 worker: the node agents and oobleck_hpc.train) is
submitted with `oobleck_hpc.launch.submit`.

- The pre-timeout signal (USR2, as `--signal=USR2@90` sends it before the time limit) reaches the
  job's steps: every rank stops at one step boundary and saves that step, the agents exit 75, the
  launch driver asks Slurm to requeue, the same job id comes back (SLURM_RESTART_COUNT=1),
  restores that exact step and finishes.
- The batch node dies together with the other replica of its layers (beyond f=1): the survivors
  fall back, the last one asks Slurm to requeue (the driver died with its node) on the two nodes
  left (the killed ones stay DOWN), and the job comes back there and resumes from its latest
  periodic checkpoint. (The batch node alone is an ordinary node
  loss under --no-kill, recovered in place: tests/test_slurm_training.py.)

~2.5 min on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import wait_until

from oobleck_hpc.records.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def write_job(tmp_path: Path, name: str, steps: int) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "run_dir": str(tmp_path / name),
        "model": {"name": "gpt-tiny", "seed": 0},
        "data": {"cache_dir": str(ROOT / ".cache" / "oobleck_hpc")},
        "train": {"steps": steps, "microbatch_size": 2, "global_microbatches": 8, "lr": 1e-3,
                  "warmup_steps": 2},
        "cluster": {"launch": "slurm", "nodes": 4, "gpus_per_node": 1, "device": "cpu"},
        "fault_tolerance": {"f": 1, "collective_timeout_s": 20},
        "profile": {"library": str(tmp_path / "no-profiles"), "analytic": True, "device": "A40"},
        "checkpoint": {"dir": str(tmp_path / name / "ckpt"), "every_steps": 0},
        "slurm": {"time_min": 5},
    }))
    return path


def heartbeat(run_dir: Path) -> int:
    """The step in the job's heartbeat file; -1 before the first one (or while it is replaced)."""
    try:
        return json.loads((run_dir / "heartbeat").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def logs(run_dir: Path, pattern: str) -> str:
    return "\n".join(f.read_text(errors="replace") for f in sorted((run_dir / "logs").glob(pattern)))


@pytest.mark.timeout(240)
def test_usr2_checkpoints_requeues_and_resumes_the_exact_step(slurm_cluster, tmp_path):
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch.slurm import submit

    steps = 100  # ~0.1 s each here: the signal comes after a few, run 1 does the rest
    run_dir = tmp_path / "usr2"
    submitted = submit(load_job(write_job(tmp_path, "usr2", steps)))
    job_id = submitted.job_id
    try:
        wait_until(lambda: heartbeat(run_dir) >= 3, 90, "the job to train a few steps")
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        result = submitted.result()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)  # no-op once it completed
    assert (result.job_id, result.restart_count, result.exit_code) == (job_id, 1, 0), result
    first = json.loads((run_dir / f"launch-{job_id}-r0.json").read_text())
    assert first["exit_code"] == 75 and first["lost_nodes"] == [], first

    # Run 0: every rank stopped at the same step, after receiving the signal.
    r0 = logs(run_dir, f"agent-{job_id}-r0-*")
    stopped = {int(s) for s in re.findall(r"stopping at step (\d+)", r0)}
    assert "received SIGUSR2" in r0 and len(stopped) == 1, r0
    step = stopped.pop()
    assert 0 < step < steps
    # Run 1 (the same job id, SLURM_RESTART_COUNT=1) restored exactly that step and finished.
    r1 = logs(run_dir, f"agent-{job_id}-r1-*")
    assert f"restored step {step} (cursor {step * 16})" in r1, r1
    assert json.loads((run_dir / "heartbeat").read_text())["step"] == steps
    rows = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert sum("REQUEUED" in r for r in rows) == 1, rows


@pytest.mark.timeout(240)
def test_losing_the_batch_node_beyond_the_guarantee_requeues_and_resumes(slurm_cluster, tmp_path):
    """Two nodes die at once, the batch host (driver) and the other pipeline's replica of the
    batch host's layers: beyond f=1. The survivors fall back (exit 75); with the driver gone the
    last of them asks Slurm to requeue (slurm_task) on the nodes left; the same job id comes back
    on them (the killed nodes stay DOWN) and resumes from the latest periodic checkpoint."""
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch.slurm import submit

    steps = 300  # ~0.06 s each: the kills must come well before the end, on a loaded machine too
    job_file = write_job(tmp_path, "batch", steps)
    data = yaml.safe_load(job_file.read_text())
    data["checkpoint"]["every_steps"] = 5
    job_file.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "batch"
    submitted = submit(load_job(job_file))
    job_id = submitted.job_id
    try:
        wait_until(lambda: heartbeat(run_dir) >= 7, 90, "the first checkpoint")
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                             check=True).stdout
        batch_host = re.search(r"BatchHost=(\S+)", out).group(1)
        # The plan (rank 0's plan_chosen event): pipelines of stages "L<a>-<b>@<node>:<gpu>".
        plans = [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "plan_chosen"]
        assert plans and plans[0]["generation"] == 0, \
            f"the job did not start on all four nodes: plans {plans}; see {run_dir}/logs"
        chosen = plans[0]
        stages = [re.findall(r"L(\d+)-(\d+)@(\w+):", line) for line in chosen["layout"]]
        mine = next(p for p in stages if any(n == batch_host for _, _, n in p))
        lo, hi = next((int(a), int(b)) for a, b, n in mine if n == batch_host)
        other = next(n for p in stages if p is not mine for a, b, n in p
                     if int(a) <= hi and lo <= int(b))  # holds some of the same layers
        # Both at the same moment (one kill-node call): one after the other, the survivors
        # would recover from the first loss in place and re-replicate before the second.
        killed = subprocess.run([str(slurm_cluster), "kill-node", batch_host, other],
                                capture_output=True, text=True, timeout=30)
        assert killed.returncode == 0, killed.stderr
        try:
            wait_until(lambda: "Restarts=1" in subprocess.run(
                ["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout,
                60, "Slurm to requeue the job")
        except TimeoutError as e:
            raise AssertionError(f"{e}; {killed.stderr.strip()}; agents' logs:\n"
                                 + logs(run_dir, f"agent-{job_id}-r0-*")[-6000:]) from None
        # The killed nodes stay DOWN: the job comes back on the two nodes left.
        result = submitted.result()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        subprocess.run([str(slurm_cluster), "up"], capture_output=True, timeout=120)
    assert (result.job_id, result.restart_count, result.exit_code) == (job_id, 1, 0), result
    first = json.loads((run_dir / f"launch-{job_id}-r0.json").read_text())
    assert first["exit_code"] == 75 and sorted(first["lost_nodes"]) == sorted([batch_host, other])
    assert first["finished_by"] not in (batch_host, other), first
    left = sorted(set(first["nodes"]) - {batch_host, other})
    assert sorted(result.nodes) == left, result  # run 1 started on the nodes left
    r1 = logs(run_dir, f"agent-{job_id}-r1-*")
    restored = [int(s) for s in re.findall(r"restored step (\d+) \(cursor (?:\d+)\)", r1)]
    assert len(set(restored)) == 1 and restored[0] >= 5 and restored[0] % 5 == 0, r1
    assert json.loads((run_dir / "heartbeat").read_text())["step"] == steps
