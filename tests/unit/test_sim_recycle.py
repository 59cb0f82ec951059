"""The ReCycle-like policy (sim/recycle.py) by hand: a loss re-routes the lost node's
micro-batches to its peers at the bubble-filling rate of the model, nothing is re-planned; a
stage left with no peer falls back to the checkpoint; a joining node takes a lost one's place;
and it runs beside oobleck on the same trace (`simulate JOB.yaml --policies oobleck,recycle`)."""

from __future__ import annotations

import pytest

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.profiling import resolve_profile
from oobleck_hpc.sim import run_policies
from oobleck_hpc.sim.planner_backend import CostParams, PlannerModel, planner_backends
from oobleck_hpc.sim.recycle import RecycleBackend
from oobleck_hpc.sim.trace import Trace, TraceEvent, fixed_interval, node_names


@pytest.fixture(scope="module")
def model() -> PlannerModel:
    job = job_from_dict({
        "name": "sim-recycle", "model": {"name": "gpt3-350m", "dtype": "bfloat16"},
        "train": {"microbatch_size": 1, "global_microbatches": 32},
        "cluster": {"nodes": 8, "gpus_per_node": 2, "device": "cuda"},
        "fault_tolerance": {"f": 1},
        "profile": {"analytic": True, "device": "A100-80G"}})
    return PlannerModel(job, resolve_profile(job), CostParams(regroup_s=1.5))


def test_a_loss_is_re_routed_to_the_peers_of_its_stage(model):
    backend = RecycleBackend(model)
    nodes = node_names(8)
    backend.reset(nodes)
    assert backend.shape is not None
    it0, t, p = backend.shape
    assert p >= 2 and t * p <= 8
    m = 32 / p
    run, cost = backend.reroute(nodes[0])  # stage 0 of pipeline 0
    slots = m + t - 1
    extra = max(0.0, m / (p - 1) - (t - 1))
    assert run.iteration_s == pytest.approx(it0 * (slots + extra) / slots)
    assert run.nodes_used == t * p - 1
    assert cost == pytest.approx(model.detect_s + 1.5)  # nothing copied
    # a joining node takes its place: back to the plan of the start
    refill = backend.refill("new0")
    assert refill is not None and refill[0].iteration_s == pytest.approx(it0)
    assert refill[1] > 1.5
    assert backend.refill("new1") is None  # no stage short: it idles


def test_a_stage_with_no_peer_left_falls_back_to_the_checkpoint(model):
    backend = RecycleBackend(model)
    nodes = node_names(8)
    backend.reset(nodes)
    assert backend.shape is not None
    _, t, p = backend.shape
    same_stage = [nodes[i * t] for i in range(p)]  # stage 0 of every pipeline
    trace = Trace(nodes, tuple(TraceEvent(600.0 * (k + 1), "fail", n)
                               for k, n in enumerate(same_stage)))
    res = run_policies(planner_backends(model.job, model.profile, model.params, 600.0,
                                        ("recycle",)), trace, 3600.0, ("recycle",))["recycle"]
    assert res.fallbacks == 1 and res.seconds["restart"] > 0
    assert any("no data-parallel peer left" in note for note in res.notes)
    assert sum(res.seconds.values()) == pytest.approx(3600.0)


def test_recycle_runs_beside_oobleck_on_the_same_trace(model):
    duration = 6 * 3600.0
    trace = fixed_interval(node_names(8), 3600.0, duration, seed=3, replace_after_s=1800.0)
    res = run_policies(planner_backends(model.job, model.profile, model.params,
                                        trace.mean_failure_interval_s(duration),
                                        ("oobleck", "recycle")),
                       trace, duration, ("oobleck", "recycle"))
    for r in res.values():
        assert r.failures == 5
        assert sum(r.seconds.values()) == pytest.approx(duration)
        assert r.samples > 0
