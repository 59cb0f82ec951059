"""The CUDA/NCCL path, on a machine with GPUs (scripts/gpu-check.sh; skipped elsewhere, so CI,
which has none, runs nothing here).

One GPU: the compute clock (CUDA events: the GPU's time, not the launches') and a one-node run.
With two or more, one node per GPU (the local launcher, `cluster.device: cuda`, one worker per
pretend node: NCCL refuses two ranks on one GPU). Runs are fp64 on the GPU, compared with the
fp64 single-process reference on the CPU (tolerance 1e-6: the same arithmetic on another
device):

- engine equivalence: the planner's plan trained by the engine over NCCL equals the reference;
- recovery: a node killed in the backward pass (and, with 3 GPUs or more, one killed inside the
  commit vote) -- the survivors abort the generation's communicators, rebuild eager groups bound
  to their GPUs, receive the lost layers straight into their new engine and replay the step;
  every loss and the final parameters equal the reference, and no survivor is taken down by an
  abandoned collective's watchdog (the job exits 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from oobleck_hpc.config import job_from_dict

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = torch.distributed.is_available() and torch.distributed.is_nccl_available()
HERE = f"this machine: {GPUS} GPUs, NCCL {'available' if NCCL else 'not available'}"
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(GPUS < 1 or not NCCL, reason=f"needs CUDA and NCCL ({HERE})")]
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs ({HERE})")
STEPS = 6
TOL = 1e-6


def job_dict(run_dir: Path, nodes: int, faults=()) -> dict:
    return {"name": "gpu-check", "model": {"name": "gpt-tiny", "seed": 0, "dtype": "float64"},
            "train": {"steps": STEPS, "microbatch_size": 2, "global_microbatches": 4,
                      "lr": 1e-3, "warmup_steps": 2, "log_every": 1, "save_final_params": True},
            "cluster": {"launch": "local", "nodes": nodes, "gpus_per_node": 1, "device": "cuda"},
            "fault_tolerance": {"f": min(1, nodes - 1), "collective_timeout_s": 30.0,
                                "heartbeat_s": 0.5, "lease_s": 3.0},
            "profile": {"library": str(run_dir / "no-profiles"), "analytic": True,
                        "device": "A40"},
            "run_dir": str(run_dir), "faults": list(faults)}


@pytest.fixture(scope="module")
def reference():
    from oobleck_hpc.engine import reference_run

    return reference_run(job_from_dict(job_dict(Path("/nonexistent"), 2)), STEPS)


def run(tmp_path: Path, nodes: int, faults=()):
    from oobleck_hpc.launch.local import LocalRun

    run_dir = tmp_path / "run"
    data = job_dict(run_dir, nodes, faults)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    code = LocalRun(job_from_dict(data, str(path)), path, run_dir, run_dir / "metrics.jsonl",
                    kill_grace_s=20.0).run()
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():  # (it failed before a step: say why)
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}"
                         for p in sorted((run_dir / "logs").glob("*")))
        pytest.fail(f"exit {code} before a step; logs:\n{logs}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return code, rows, run_dir


def check(code, rows, run_dir, reference) -> None:
    ref_losses, ref_params = reference
    assert code == 0, f"exit {code} (logs: {run_dir / 'logs'})"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], ref_losses, rtol=TOL)
    for layer, params in ref_params.items():
        got = torch.load(run_dir / "final" / f"layer-{layer}.pt")
        for name, value in params.items():
            diff = float((got[name] - value).abs().max() / value.abs().max().clamp_min(1e-30))
            assert diff <= TOL, f"layer {layer} {name}: {diff}"


@pytest.mark.timeout(120)
def test_the_compute_clock_times_the_gpu_not_the_kernel_launches():
    """engine/clock.py's ComputeClock on CUDA (a straggler's evidence, recovery/straggler.py): around work
    the GPU takes far longer to run than the host to launch, it reads the GPU's time."""
    import time

    from oobleck_hpc.engine.clock import ComputeClock

    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()  # (warm up: kernels, allocator)
    clock = ComputeClock(torch.device("cuda"))
    launched = ran = 0.0
    for _ in range(3):  # three computations in a step
        torch.cuda.synchronize()
        t = time.perf_counter()
        start = clock.start()
        for _ in range(50):
            a = torch.tanh(a @ a)
        clock.stop(start)
        launched += time.perf_counter() - t  # (what host timing would have read)
        torch.cuda.synchronize()
        ran += time.perf_counter() - t
    assert launched < 0.5 * ran, f"not GPU-bound ({launched} of {ran} s): the check says nothing"
    assert 0.8 * ran <= clock.seconds() <= 1.05 * ran, (clock.seconds(), ran)


@pytest.mark.timeout(300)
def test_one_node_on_a_gpu_equals_the_reference(tmp_path, reference):
    """The engine, driver and commit vote (compute figures from CUDA events) on one GPU."""
    check(*run(tmp_path, 1), reference)


@TWO_GPUS
@pytest.mark.timeout(300)
def test_engine_over_nccl_equals_the_reference(tmp_path, reference):
    check(*run(tmp_path, min(GPUS, 4)), reference)


@TWO_GPUS
@pytest.mark.timeout(300)
def test_a_node_killed_in_backward_is_recovered_in_place_over_nccl(tmp_path, reference):
    code, rows, run_dir = run(tmp_path, min(GPUS, 4), [
        {"node": 1, "step": 3, "phase": "backward", "kind": "kill"}])
    check(code, rows, run_dir, reference)
    assert rows[-1]["generation"] >= 1


@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 3, reason="a kill inside the vote keeping a majority needs 3 GPUs")
def test_a_node_killed_in_the_commit_vote_is_settled_over_nccl(tmp_path, reference):
    code, rows, run_dir = run(tmp_path, min(GPUS, 4), [
        {"node": 2, "step": 4, "phase": "vote", "kind": "kill"}])
    check(code, rows, run_dir, reference)
