"""The cost model's measured inputs: per-row compute of a split stage, the optimizer step, the
shared-cores scaling and the per-step statistics all-reduce (planning/cost.py)."""

from __future__ import annotations

import dataclasses

import pytest

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.planning import cost, plan_job
from oobleck_hpc.profiling.profile import (
    Fingerprint,
    LayerProfile,
    LinkCost,
    MachineProfile,
    ModelProfile,
)


def profile(mb: int = 2, rows: bool = True, device: str = "cpu") -> ModelProfile:
    fp = Fingerprint(model_name="toy", arch_hash="x", microbatch_size=mb, dtype="float32",
                     device_name=device, gpus_per_node=2, interconnect="loopback")
    link = LinkCost(0.1, 1e9)
    machine = MachineProfile(device, 1 << 30, 2, link, link, link, link)
    layers = tuple(LayerProfile(
        name=f"l{i}", forward_ms=2.0, backward_ms=4.0, param_bytes=1000, grad_bytes=1000,
        optimizer_bytes=2000, activation_bytes=100, output_bytes=100, optimizer_ms=0.5,
        forward_rows_ms=(1.5, 2.0) if rows else (), backward_rows_ms=(3.0, 4.0) if rows else ())
        for i in range(4))
    return ModelProfile(fp, machine, layers)


def test_split_stage_uses_the_time_at_its_rows():
    p = profile()
    # 2 GPUs share 2 rows: each runs 1 row, measured 1.5 / 3.0 ms (not 2.0 / 2 = 1.0)
    assert cost.stage_forward_ms(p, 0, 4, 2) == pytest.approx(4 * 1.5)
    assert cost.stage_backward_ms(p, 0, 4, 2, 1) == pytest.approx(
        4 * 3.0 + cost.stage_allreduce_ms(p, 0, 4, 2) + 4 * 0.5)
    assert cost.stage_forward_ms(p, 0, 4, 1) == pytest.approx(4 * 2.0)
    # without per-row times (analytic, schema 1): the ideal split
    q = profile(rows=False)
    assert cost.stage_forward_ms(q, 0, 4, 2) == pytest.approx(4 * 1.0)


def test_optimizer_step_is_paid_once_per_step_by_a_single_stage():
    p = profile()
    for m in (1, 3, 8):
        t = cost.stage_forward_ms(p, 0, 4, 1) + cost.stage_backward_ms(p, 0, 4, 1, m)
        assert m * t == pytest.approx(m * 4 * 6.0 + 4 * 0.5)


def test_shared_cores_scale_compute_on_cpu_only():
    assert cost.compute_oversubscription("cpu", 8, 2) == 4.0
    assert cost.compute_oversubscription("cpu", 1, 2) == 1.0
    assert cost.compute_oversubscription("A100-80G", 8, 2) == 1.0
    p = profile()
    s = cost.scale_compute(p, 4.0)
    assert s.layers[0].forward_ms == 8.0 and s.layers[0].forward_rows_ms == (6.0, 8.0)
    assert s.layers[0].optimizer_ms == 2.0 and s.machine == p.machine
    assert cost.scale_compute(p, 1.0) is p


def job(nodes: int, launch: str = "local"):
    return job_from_dict({"model": {"name": "gpt-tiny"}, "train": {"microbatch_size": 2,
                          "global_microbatches": 8},
                          "cluster": {"launch": launch, "nodes": nodes, "gpus_per_node": 2,
                                      "device": "cpu"},
                          "fault_tolerance": {"f": 1}}, "test.yaml")


def test_job_scale_counts_the_workers_sharing_this_host():
    p = profile()
    assert cost.job_compute_scale(job(4), p, cores=2) == 4.0  # 8 local workers on 2 cores
    assert cost.job_compute_scale(job(4, "slurm"), p, cores=2) == 1.0  # 2 per node
    assert cost.job_compute_scale(job(4), dataclasses.replace(
        p, machine=dataclasses.replace(p.machine, device_name="H100-80G")), cores=2) == 1.0


def test_plan_job_plans_with_the_scaled_compute(monkeypatch):
    p = profile()
    monkeypatch.setattr(cost, "host_cores", lambda: 2)
    _, templates, plan = plan_job(job(4), p, [f"n{i}" for i in range(4)])
    monkeypatch.setattr(cost, "host_cores", lambda: 8)
    _, templates1, plan1 = plan_job(job(4), p, [f"n{i}" for i in range(4)])
    t, t1 = templates[1], templates1[1]
    assert sum(t.stage_forward_ms) == pytest.approx(4 * sum(t1.stage_forward_ms))
    assert plan.predicted_iteration_ms > plan1.predicted_iteration_ms


def test_predicted_step_adds_the_statistics_allreduce():
    p = profile()
    plan = plan_job(job(2), p, ["n0", "n1"])[2]  # 2 nodes x 2 GPUs = 4 ranks
    z = cost.step_stats_ms(p, 4)
    assert z == pytest.approx(2 * 3 * (0.1 + 1000.0 * 4 / 1e9))  # ring: 2(p-1) steps of 16/p B
    assert cost.predicted_step_ms(plan, p) == pytest.approx(cost.plan_iteration_ms(plan, p) + z)
