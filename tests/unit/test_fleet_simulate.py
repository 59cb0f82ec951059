"""`simulate --fleet`: the fleet manager replayed on failure traces (fleet/simulate.py) never
does worse than every job healing on its own, on a test set of seeds and trace kinds
(independent per-node failures with repairs, correlated bursts beyond f, a fixed interval,
failures of the whole cluster with no repair); a lost node of the heaviest job is refilled from
the lightest; a job drained below its smallest plan waits and resumes; no policy passes the
ceiling (the nodes alive, best allocated at every moment); the command's options."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.fleet.allocate import decide
from oobleck_hpc.fleet.simulate import SimJob, ceiling_waf, simulate_fleet, simulate_policies
from oobleck_hpc.sim.trace import Trace, TraceEvent, bursts, exponential, fixed_interval, node_names

NODES = 24
DAY = 24 * 3600.0


def curve(smallest: int, per_node: float, power: float = 0.9) -> np.ndarray:
    """samples/s on n = 0..NODES nodes: sublinear above the smallest plan, 0 below."""
    v = per_node * np.arange(NODES + 1, dtype=float) ** power
    v[:smallest] = 0.0
    return v


JOBS = [SimJob("main", 4, 1.0, curve(4, 10.0), 512, max_nodes=12, f=1),
        SimJob("second", 2, 1.0, curve(3, 12.0), 512, max_nodes=8, f=2),
        SimJob("ablation", 1, 1.0, curve(2, 10.0, 1.0), 512, max_nodes=6),
        SimJob("finetune", 1, 1.0, curve(1, 6.0), 256, max_nodes=4)]


def traces(seed: int) -> list[Trace]:
    nodes = node_names(NODES)
    return [exponential(nodes, 48 * 3600, DAY, seed, "node", replace_after_s=4 * 3600),
            bursts(nodes, 8 * 3600, 3, DAY, seed, replace_after_s=4 * 3600),
            fixed_interval(nodes, 3600, DAY, seed, replace_after_s=6 * 3600),
            exponential(nodes, 2 * 3600, DAY, seed, "cluster")]


@pytest.mark.parametrize("seed", range(5))
def test_the_fleet_is_never_below_every_job_on_its_own(seed):
    for trace in traces(seed):
        r = simulate_policies(JOBS, trace, DAY, 3 * 3600.0)
        fleet, own = r["fleet"].mean_waf, r["own"].mean_waf
        assert fleet >= own, f"{trace.description} seed {seed}: fleet {fleet} < own {own}"
        assert r["own"].moves == r["restart"].moves == 0
        ceiling = ceiling_waf(JOBS, trace, DAY)  # the bound is one: no policy passes it
        assert max(res.mean_waf for res in r.values()) <= ceiling * (1 + 1e-12)
        for res in r.values():  # every job's seconds add up to the simulated time
            for job in res.jobs.values():
                assert sum(job.seconds.values()) == pytest.approx(DAY)


def test_without_failures_every_policy_trains_at_the_decision():
    trace = Trace(node_names(NODES), ())
    best = decide([j.curve(None) for j in JOBS], NODES)
    assert ceiling_waf(JOBS, trace, DAY) == best.total_waf
    a, b = trace.nodes[3], trace.nodes[5]  # a fails, comes back, then b fails for good
    lost = Trace(trace.nodes, (TraceEvent(DAY / 4, "fail", a), TraceEvent(DAY / 2, "add", a),
                               TraceEvent(DAY / 2, "fail", b)))
    one_less = decide([j.curve(None) for j in JOBS], NODES - 1).total_waf
    assert ceiling_waf(JOBS, lost, DAY) == pytest.approx((best.total_waf + 3 * one_less) / 4)
    for res in simulate_policies(JOBS, trace, DAY, 3 * 3600.0).values():
        assert res.nodes == [(0.0, best.nodes)]
        assert res.mean_waf == pytest.approx(best.total_waf, rel=1e-3)  # checkpoint pauses
        windows = res.waf_windows(3600.0)
        assert len(windows) == 24
        # the windows' integral also counts the step still in flight at the end
        assert sum(w for _, _, w in windows) / 24 == pytest.approx(res.mean_waf, rel=1e-4)


def test_a_lost_node_of_the_heaviest_job_comes_from_the_lightest_after_its_recovery():
    nodes = node_names(NODES)
    start = decide([j.curve(None) for j in JOBS], NODES).nodes
    victim = nodes[0]  # the first job's first node
    trace = Trace(nodes, (TraceEvent(3600.0, "fail", victim),))
    res = simulate_fleet(JOBS, trace, DAY, "fleet", 3 * 3600.0)
    assert res.nodes[0] == (0.0, start)
    t_fail, after_fail = res.nodes[1]
    assert t_fail == 3600.0 and after_fail[0] == start[0] - 1
    t_move, after_move = res.nodes[-1]
    assert t_move == pytest.approx(3600.0 + JOBS[0].transition_s)  # recovered in place first
    assert after_move[0] == start[0] and sum(after_move) == NODES - 1
    assert res.moves == 1
    own = simulate_fleet(JOBS, trace, DAY, "own", 3 * 3600.0)
    assert own.nodes[-1] == (3600.0, after_fail)
    assert res.mean_waf > own.mean_waf


def test_a_job_drained_below_its_plan_waits_and_resumes_when_nodes_come_back():
    jobs = [SimJob("heavy", 8, 1.0, curve(1, 10.0, 1.0), 512, max_nodes=4, f=3),
            SimJob("light", 1, 1.0, curve(2, 10.0, 1.0), 512, max_nodes=2)]
    nodes = node_names(6)
    fails = tuple(TraceEvent(3600.0 + i, "fail", nodes[i]) for i in range(2))
    back = tuple(TraceEvent(7200.0 + i, "add", f"new{i}") for i in range(2))
    res = simulate_fleet(jobs, Trace(nodes, fails + back), DAY, "fleet", 3 * 3600.0)
    counts = [c for _, c in res.nodes]
    assert counts[0] == (4, 2)
    assert (4, 0) in counts  # the light job gave its nodes to the heavy one and waited
    assert counts[-1] == (4, 2)  # and got nodes back when they came
    light = res.jobs["light"]
    assert light.seconds["stopped"] > 0 and light.seconds["restart"] > 0
    assert any("drained below its smallest plan" in n for n in light.notes)


def test_bursts_fail_neighbours_together_and_replace_them():
    nodes = node_names(16)
    trace = bursts(nodes, 3600.0, 4, DAY, seed=3, replace_after_s=1800.0)
    fails = [e for e in trace.events if e.kind == "fail"]
    assert fails and len(fails) % 4 == 0 or len({e.time_s for e in fails}) < len(fails)
    first = [e.node for e in fails if e.time_s == fails[0].time_s]
    assert len(first) == 4
    idx = [nodes.index(n) for n in first]
    assert idx == list(range(idx[0], idx[0] + 4))
    adds = [e for e in trace.events if e.kind == "add"]
    assert adds[0].time_s == pytest.approx(fails[0].time_s + 1800.0)
    assert trace == bursts(nodes, 3600.0, 4, DAY, seed=3, replace_after_s=1800.0)


def _args(**kw) -> argparse.Namespace:
    base = dict(file=None, fleet=None, trace=None, mtbf=None, every=None, per="cluster",
                burst=1, replace_after=None, growth=False, spares=1, time_unit="s",
                policies=None, duration=None, seed=0, json=False, plot=None, detect_s=None,
                regroup_s=2.0, restart_s=120.0, storage_gbps=20.0)
    return argparse.Namespace(**{**base, **kw})


def test_the_command_checks_its_options(tmp_path):
    from oobleck_hpc.sim.cli import main

    with pytest.raises(ConfigError, match="give exactly one"):
        main(_args())
    with pytest.raises(ConfigError, match="give exactly one"):
        main(_args(file="job.yaml", fleet="fleet.yaml"))
    with pytest.raises(ConfigError, match="is not a policy"):
        main(_args(fleet="fleet.yaml", policies="fleet,oobleck"))
    with pytest.raises(ConfigError, match="needs --mtbf"):
        main(_args(fleet="examples/fleet-tiny-local.yaml", burst=3, every=10.0))


def test_the_command_reports_json(capsys):
    from oobleck_hpc.sim.cli import main

    assert main(_args(fleet="examples/fleet-tiny-local.yaml", every=120.0, duration=6.0,
                      replace_after=60.0, json=True, policies="fleet,own")) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"fleet", "own"}
    assert out["ratio_to_own"]["own"] == 1.0 and out["ratio_to_own"]["fleet"] >= 1.0
    assert out["ratio_to_own"]["ceiling"] >= out["ratio_to_own"]["fleet"]
    fleet = out["policies"]["fleet"]
    assert fleet["failures"] == out["meta"]["failures"] == 2
    assert len(fleet["waf_windows"]) == 6 * 3600 / out["meta"]["window_s"]
