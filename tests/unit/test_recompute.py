"""Activation recomputation (`train.recompute`, issue 29 item 6): the engine's segments keep only
each layer's input for backward and give the same gradients, bit for bit; the planner charges
the recomputation (planning/cost.py `with_recompute`) and says when a job fits only with it.
(The engine on multi-node plans with recomputation against the reference: tests/test_engine.py.)"""

from __future__ import annotations

import random

import pytest
import torch
from test_planning_templates import random_profile

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.engine.stage import Segment
from oobleck_hpc.errors import PlanningError
from oobleck_hpc.models.base import build_model
from oobleck_hpc.planning import cost, plan_job
from oobleck_hpc.profiling.analytic import analytic_profile
from oobleck_hpc.profiling.layers import saved_activation_bytes


def _blocks_backward(recompute: bool):
    """gpt-tiny's 4 blocks as one segment: (bytes saved for backward, output, input grad,
    parameter grads) for one batch, in fp64."""
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(job_from_dict({"name": "r", "model": {"name": "gpt-tiny"}}).model)
        modules = [model.build_layer(i) for i in range(1, 5)]
        params = [p for m in modules for p in m.parameters()]
        seg = Segment([1, 2, 3, 4], modules, (0,), None, torch.empty(0), counts_norm=True,
                      recompute=recompute)
        x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        saved, out = saved_activation_bytes(lambda: seg.forward(x), params)
        out.square().sum().backward()
        return saved, out.detach(), x.grad, [p.grad for p in params]
    finally:
        torch.set_default_dtype(torch.float32)


def test_recomputation_keeps_each_layers_input_only_and_changes_no_value():
    full, out, gx, grads = _blocks_backward(False)
    kept, out_r, gx_r, grads_r = _blocks_backward(True)
    layer_input = 2 * 64 * 64 * 8  # (B, T, d) in fp64
    assert kept <= 4 * layer_input < full / 5, (kept, full)
    assert torch.equal(out, out_r) and torch.equal(gx, gx_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def test_the_planner_charges_the_recomputation():
    prof = random_profile(random.Random(3), 6, 2, memory=10**9)
    rc = cost.with_recompute(prof)
    for i, (x, y) in enumerate(zip(prof.layers, rc.layers)):
        assert y.activation_bytes == (x.activation_bytes if i == 0
                                      else prof.layers[i - 1].output_bytes)
        assert y.backward_ms == pytest.approx(x.backward_ms + x.forward_ms)
        assert (y.forward_ms, y.param_bytes, y.optimizer_bytes) == (
            x.forward_ms, x.param_bytes, x.optimizer_bytes)
    reserve = max(x.activation_bytes for x in prof.layers)
    assert rc.machine.device_memory_bytes == prof.machine.device_memory_bytes - reserve


def test_a_job_that_fits_only_with_recomputation_is_told_so():
    """GPT-3 13B in microbatches of 32 on 16 nodes of 8 A100-80G: no pipeline holds its
    activations; with recomputation one node holds a replica."""
    def job(recompute: bool):
        return job_from_dict({"name": "big", "model": {"name": "gpt3-13b"},
                              "train": {"microbatch_size": 32, "global_microbatches": 32,
                                        "recompute": recompute},
                              "cluster": {"nodes": 16, "gpus_per_node": 8, "device": "cuda"}})

    prof = analytic_profile("gpt3-13b", "A100-80G", 32)
    nodes = [f"node{i}" for i in range(16)]
    with pytest.raises(PlanningError, match="with train.recompute: true in .* it fits"):
        plan_job(job(False), prof, nodes)
    spec, _, plan = plan_job(job(True), prof, nodes)
    assert spec.n0 == 1 and len(plan.pipelines) >= 2
