"""The cost model's measured inputs: per-row compute of a split stage, the optimizer step, the
shared-cores slowdown, the segments' all-reduces and the per-step statistics all-reduce (planning/cost.py)."""

from __future__ import annotations

import dataclasses

import pytest

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.planning import cost, plan_job
from oobleck_hpc.planning.plan import PipelineSpec, Plan
from oobleck_hpc.planning.templates import make_template
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


def test_shared_cores_slow_down_every_time_on_cpu_only():
    p = profile()
    m = p.machine
    assert cost.host_slowdown(m, 8, 2) == 4.0  # no measured table: ideal sharing, W / C
    assert cost.host_slowdown(m, 1, 2) == 1.0
    assert cost.host_slowdown(dataclasses.replace(m, device_name="A100-80G"), 8, 2) == 1.0
    # the measured table: entry k-1 = k workers per core; linear between, proportional past it
    t = dataclasses.replace(m, core_sharing=(1.0, 2.2, 3.6))
    assert cost.host_slowdown(t, 4, 2) == pytest.approx(2.2)
    assert cost.host_slowdown(t, 5, 2) == pytest.approx(2.9)
    assert cost.host_slowdown(t, 3, 2) == pytest.approx(1.6)
    assert cost.host_slowdown(t, 12, 2) == pytest.approx(3.6 * 6 / 3)
    s = cost.scale_times(p, 4.0)
    assert s.layers[0].forward_ms == 8.0 and s.layers[0].forward_rows_ms == (6.0, 8.0)
    assert s.layers[0].optimizer_ms == 2.0
    assert s.machine.p2p_inter.time_ms(1000) == pytest.approx(4 * m.p2p_inter.time_ms(1000))
    assert s.machine.allreduce_intra.time_ms(1e6) == pytest.approx(4 * m.allreduce_intra.time_ms(1e6))
    assert cost.scale_times(p, 1.0) is p


def job(nodes: int, launch: str = "local"):
    return job_from_dict({"model": {"name": "gpt-tiny"}, "train": {"microbatch_size": 2,
                          "global_microbatches": 8},
                          "cluster": {"launch": launch, "nodes": nodes, "gpus_per_node": 2,
                                      "device": "cpu"},
                          "fault_tolerance": {"f": 1}}, "test.yaml")


def test_job_scale_counts_the_workers_sharing_this_host():
    p = profile()
    assert cost.job_slowdown(job(4), p, cores=2) == 4.0  # 8 local workers on 2 cores
    assert cost.job_slowdown(job(4, "slurm"), p, cores=2) == 1.0  # 2 per node
    assert cost.job_slowdown(job(4), dataclasses.replace(
        p, machine=dataclasses.replace(p.machine, device_name="H100-80G")), cores=2) == 1.0


def test_shared_cores_change_the_prediction_not_the_plan(monkeypatch):
    p = profile()
    monkeypatch.setattr(cost, "host_cores", lambda: 2)
    _, templates, plan = plan_job(job(4), p, [f"n{i}" for i in range(4)])
    monkeypatch.setattr(cost, "host_cores", lambda: 8)
    _, templates1, plan1 = plan_job(job(4), p, [f"n{i}" for i in range(4)])
    t, t1 = templates[1], templates1[1]
    assert sum(t.stage_forward_ms) == pytest.approx(4 * sum(t1.stage_forward_ms))
    assert plan.predicted_iteration_ms == pytest.approx(4 * plan1.predicted_iteration_ms)
    def shape(pl):  # which templates (stage layers and GPUs) on which nodes, how many microbatches
        return [([(st.layer_start, st.layer_end, st.gpus) for st in q.template.stages], q.nodes,
                 q.microbatches) for q in pl.pipelines]
    assert shape(plan) == shape(plan1)


def test_predicted_step_charges_the_segments_as_executed():
    p = profile()
    # 2 nodes x 2 GPUs = 4 ranks: z is a ring of 2(p-1) steps of 16/p bytes over all of them
    z = cost.step_stats_ms(p, 4)
    assert z == pytest.approx(2 * 3 * (0.1 + 1000.0 * 4 / 1e9))
    # two single-stage 2-GPU pipelines: every layer is held by all 4 ranks, one segment of
    # 4 x 1000 bytes, one ring all-reduce among 4
    t = make_template(p, [(0, 4, 2, 0, 0)], 1, 2)
    plan = Plan((PipelineSpec(t, ("n0",), 2), PipelineSpec(t, ("n1",), 2)), 4, 0.0)
    ring = cost.allreduce_ms(p.machine.allreduce_inter, 4000, 4)
    assert cost.rank_sync_ms(plan, p) == pytest.approx([ring] * 4)
    # the pipeline without the in-stage all-reduce and optimizer shares: per microbatch, the
    # forward and backward of one row (1.5 + 3.0 ms) on each of the 4 layers; then the ring,
    # z, and the optimizer step of the 4 layers (0.5 ms each)
    assert cost.executed_pipeline_ms(t, 2, p) == pytest.approx(2 * 4 * 4.5)
    assert cost.predicted_step_ms(plan, p) == pytest.approx(2 * 4 * 4.5 + ring + z + 4 * 0.5)
    # one pipeline of two 1-GPU stages on one node: each layer has one holder, nothing to reduce
    t2 = make_template(p, [(0, 2, 1, 0, 0), (2, 4, 1, 0, 1)], 1, 4)
    single = Plan((PipelineSpec(t2, ("n0",), 4),), 4, 0.0)
    assert cost.rank_sync_ms(single, p) == [0.0, 0.0]
    c = cost.send_ms(p, 1, True)
    assert cost.predicted_step_ms(single, p) == pytest.approx(
        2 * 12.0 + 2 * c + 3 * 12.0 + cost.step_stats_ms(p, 2) + 2 * 0.5)
