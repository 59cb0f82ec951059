"""Goodput simulator: traces, accounting, policy semantics, the paper preset, the CLI and a
planner-driven run. Pure arithmetic: no processes, no torch."""

from __future__ import annotations

import bisect
import json
import math
import struct
from pathlib import Path

import pytest

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.sim import run_policies
from oobleck_hpc.sim.engine import CATEGORIES, simulate
from oobleck_hpc.sim.policies import OobleckPolicy, RedundantPolicy, RestartPolicy
from oobleck_hpc.sim.scenario import (PolicyTable, Scenario, TableBackend, load_scenario,
                                      scenario_backends)
from oobleck_hpc.sim.trace import (Trace, TraceEvent, exponential, fixed_interval, load_trace,
                                   node_names)

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "examples" / "bert-large-paper.yaml"


def _scenario(nodes: int = 8) -> Scenario:
    tput = {n: 10.0 * n for n in range(2, nodes + 1)}
    return Scenario(
        name="toy", nodes=nodes, samples_per_iteration=100.0, policies={
            "oobleck": PolicyTable(tput, restart_s=30, reconfiguration_s=2, f=1,
                                   checkpoint_s=0.5, checkpoint_every_steps=20),
            "restart": PolicyTable(tput, restart_s=30, checkpoint_s=3, checkpoint_every_steps=4),
            "redundant": PolicyTable({n: 4.0 * n for n in range(2, nodes + 1)}, useful=0.6,
                                     reconfiguration_s=10, restart_s=30, checkpoint_s=3,
                                     checkpoint_every_steps=10)})


def _check_accounting(results, duration, step_samples=None):
    for r in results.values():
        assert set(r.seconds) == set(CATEGORIES)
        assert math.isclose(sum(r.seconds.values()), duration, rel_tol=1e-9, abs_tol=1e-6), r.seconds
        assert all(v >= -1e-6 for v in r.seconds.values()), r.seconds
        assert r.samples >= 0
        # the timeline covers [0, duration] without gaps
        assert r.timeline[0][0] == 0 and math.isclose(r.timeline[-1][1], duration)
        for (a0, a1, _), (b0, b1, _) in zip(r.timeline, r.timeline[1:]):
            assert math.isclose(a1, b0, abs_tol=1e-9) and a1 >= a0
        _check_goodput(r, duration, step_samples)


def _integral(series):
    return sum((t1 - t0) * rate for t0, t1, rate in series)


def _check_goodput(r, duration, step_samples=None):
    """The goodput series covers [0, duration] without gaps; at every instant it is either the
    throughput (work kept) or 0 (work thrown away, or no training); it integrates to the samples
    kept plus at most one step still in flight at the end."""
    g = r.goodput
    assert g[0][0] == 0 and math.isclose(g[-1][1], duration)
    for (a0, a1, _), (b0, _, _) in zip(g, g[1:]):
        assert math.isclose(a1, b0, abs_tol=1e-9) and a1 >= a0
    starts = [t0 for t0, _, _ in r.timeline]
    for t0, t1, rate in g:
        mid = (t0 + t1) / 2
        _, _, tput = r.timeline[bisect.bisect_right(starts, mid) - 1]
        assert rate == 0 or rate == tput, (t0, t1, rate, tput)
    area = _integral(g)
    assert area >= r.samples * (1 - 1e-9) - 1e-6, (r.policy, area, r.samples)
    if step_samples is not None:
        assert area <= r.samples + step_samples * (1 + 1e-9), (r.policy, area, r.samples)
    assert area <= _integral(r.timeline) * (1 + 1e-12) + 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_accounting_adds_up_to_the_simulated_time(seed):
    s = _scenario()
    nodes = node_names(s.nodes)
    duration = 6 * 3600.0
    traces = [
        fixed_interval(nodes, 700.0, duration, seed),
        exponential(nodes, 900.0, duration, seed, per="cluster", replace_after_s=1200.0),
        exponential(nodes, 4 * 3600.0, duration, seed, per="node", replace_after_s=600.0),
        # bursts: simultaneous and back-to-back failures, an arrival during recovery
        Trace(nodes, (TraceEvent(100.0, "fail", nodes[0]), TraceEvent(100.0, "fail", nodes[1]),
                      TraceEvent(101.0, "fail", nodes[2]), TraceEvent(105.0, "add", "x1"),
                      TraceEvent(3000.0, "fail", nodes[3]), TraceEvent(3001.0, "add", "x2"),
                      TraceEvent(3001.5, "fail", "x2"))),
    ]
    for trace in traces:
        _check_accounting(run_policies(scenario_backends(s), trace, duration), duration,
                          s.samples_per_iteration)


def test_deterministic_with_a_seed():
    s = _scenario()
    nodes = node_names(s.nodes)
    a = exponential(nodes, 1800.0, 86400.0, seed=7, per="node", replace_after_s=900.0)
    b = exponential(nodes, 1800.0, 86400.0, seed=7, per="node", replace_after_s=900.0)
    c = exponential(nodes, 1800.0, 86400.0, seed=8, per="node", replace_after_s=900.0)
    assert a == b and a != c
    ra = run_policies(scenario_backends(s), a, 86400.0)
    rb = run_policies(scenario_backends(s), b, 86400.0)
    assert {k: v.to_dict() for k, v in ra.items()} == {k: v.to_dict() for k, v in rb.items()}


def test_exponential_rate_matches_mtbf():
    nodes = node_names(64)
    trace = exponential(nodes, 600.0, 200 * 3600.0, seed=1, per="cluster", replace_after_s=60.0)
    fails = trace.failures
    expected = 200 * 3600.0 / 600.0
    assert abs(fails - expected) < 4 * math.sqrt(expected)
    per_node = exponential(nodes, 64 * 600.0, 200 * 3600.0, seed=1, per="node",
                           replace_after_s=60.0)
    assert abs(per_node.failures - expected) < 4 * math.sqrt(expected)


def test_single_failure_by_hand():
    """One failure at t=35 s; 10 s steps; every number below is computed by hand."""
    table = PolicyTable({4: 10.0, 3: 10.0}, restart_s=30, reconfiguration_s=2,
                        checkpoint_s=1, checkpoint_every_steps=2)
    nodes = ("a", "b", "c", "d")
    trace = Trace(nodes, (TraceEvent(35.0, "fail", "c"),))
    # oobleck (no checkpoints): steps 0-10-20-30, step 4 interrupted at 35 (5 s lost),
    # reconfiguration 35-37, then training to 100.
    ob = TableBackend(PolicyTable({4: 10.0, 3: 10.0}, reconfiguration_s=2), 100.0)
    r = simulate(OobleckPolicy(ob), trace, 100.0)
    assert r.seconds["lost"] == pytest.approx(5.0)
    assert r.seconds["reconfiguration"] == pytest.approx(2.0)
    assert r.seconds["effective"] == pytest.approx(93.0)
    assert r.steps == 3 + 6 and r.samples == pytest.approx(900.0)
    # restart: steps 0-10, 10-20, ckpt 20-21, steps 21-31, interrupted at 35: steps of 21-35
    # lost (14 s), restart 35-65, steps 65-75, 75-85, ckpt 85-86, step 86-96, 96-100 partial.
    r = simulate(RestartPolicy(TableBackend(table, 100.0), checkpoint_s=1,
                               checkpoint_every_steps=2), trace, 100.0)
    assert r.seconds["lost"] == pytest.approx(14.0)
    assert r.seconds["restart"] == pytest.approx(30.0)
    assert r.seconds["checkpoint"] == pytest.approx(2.0)
    assert r.seconds["effective"] == pytest.approx(54.0)
    assert r.steps == 2 + 3 and r.fallbacks == 1


def test_goodput_by_hand_counts_lost_work_as_zero():
    """The trace of test_single_failure_by_hand: goodput is the throughput except where the
    training was thrown away (restart: all since the checkpoint at 21 s; oobleck: the step in
    flight), and 0 during checkpoints and recoveries."""
    table = PolicyTable({4: 10.0, 3: 10.0}, restart_s=30, reconfiguration_s=2,
                        checkpoint_s=1, checkpoint_every_steps=2)
    trace = Trace(("a", "b", "c", "d"), (TraceEvent(35.0, "fail", "c"),))
    r = simulate(RestartPolicy(TableBackend(table, 100.0), checkpoint_s=1,
                               checkpoint_every_steps=2), trace, 100.0)
    assert r.timeline == [(0, 20, 10), (20, 21, 0), (21, 35, 10), (35, 65, 0), (65, 85, 10),
                          (85, 86, 0), (86, 100, 10)]
    # 21-35 trained at 10 samples/s, then thrown away by the fallback: goodput 0 there
    assert r.goodput == [(0, 20, 10), (20, 65, 0), (65, 85, 10), (85, 86, 0), (86, 100, 10)]
    # 5 whole steps kept + 4 s of the step in flight at the end (not thrown away)
    assert _integral(r.goodput) == pytest.approx(r.samples + 40.0) == pytest.approx(540.0)
    # the throughput series also counts the 14 s that were thrown away
    assert _integral(r.timeline) == pytest.approx(_integral(r.goodput) + 140.0)
    ob = simulate(OobleckPolicy(TableBackend(PolicyTable({4: 10.0, 3: 10.0},
                                                         reconfiguration_s=2), 100.0)),
                  trace, 100.0)
    assert ob.timeline == [(0, 35, 10), (35, 37, 0), (37, 100, 10)]
    assert ob.goodput == [(0, 30, 10), (30, 37, 0), (37, 100, 10)]
    # windows average the series and keep its integral
    wins = r.goodput_windows(30.0)
    assert [(a, b) for a, b, _ in wins] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert [g for _, _, g in wins] == pytest.approx([200 / 30, 0, 240 / 30, 10])
    assert r.goodput_cumulative()[-1] == (100, pytest.approx(540.0))


def test_restart_goodput_is_below_its_throughput_when_failures_happen():
    s = load_scenario(PAPER)
    duration = s.duration_hours * 3600
    trace = fixed_interval(node_names(s.nodes), 60 * s.every_minutes, duration, seed=0)
    res = run_policies(scenario_backends(s), trace, duration)
    rs = res["restart"]
    assert rs.fallbacks == 14
    good, tput = _integral(rs.goodput), _integral(rs.timeline)
    # every fallback throws away up to 10 steps: a large share of what was trained
    assert good < 0.75 * tput
    # and the loss shows where it happened: the windows before a failure lose their work
    starts = [t0 for t0, _, _ in rs.timeline]
    lost_while_training = [
        (t0, t1) for t0, t1, g in rs.goodput
        if g == 0 and rs.timeline[bisect.bisect_right(starts, (t0 + t1) / 2) - 1][2] > 0]
    assert len(lost_while_training) == 14
    # oobleck loses only the interrupted steps; redundancy loses nothing here
    ob, rd = res["oobleck"], res["redundant"]
    assert _integral(ob.goodput) > 0.97 * _integral(ob.timeline)
    assert _integral(rd.goodput) == pytest.approx(_integral(rd.timeline), rel=0.02)
    assert ob.samples_per_s > rs.samples_per_s > rd.samples_per_s
    # the JSON carries both series
    d = rs.to_dict()
    assert d["goodput"] == [list(x) for x in rs.goodput] and d["timeline"]


def test_idle_and_redundant_shares():
    # 5 nodes, the table runs 4: one node in five idles; useful 0.25 of the rest.
    table = PolicyTable({4: 40.0}, useful=0.25, reconfiguration_s=5, restart_s=50)
    r = simulate(RedundantPolicy(TableBackend(table, 100.0)), Trace(node_names(5), ()), 1000.0)
    assert r.shares["idle"] == pytest.approx(0.2)
    assert r.shares["effective"] == pytest.approx(0.2)
    assert r.shares["redundant"] == pytest.approx(0.6)
    assert r.samples_per_s == pytest.approx(40.0)


def test_consecutive_failures_defeat_redundancy_and_exceed_oobleck_guarantee():
    nodes = node_names(6)
    burst = Trace(nodes, (TraceEvent(500.0, "fail", nodes[1]), TraceEvent(501.0, "fail", nodes[2])))
    spaced = Trace(nodes, (TraceEvent(500.0, "fail", nodes[1]), TraceEvent(900.0, "fail", nodes[2])))
    tput = {n: 10.0 * n for n in range(2, 7)}
    red = PolicyTable(tput, useful=0.5, reconfiguration_s=20, restart_s=60)
    r_burst = simulate(RedundantPolicy(TableBackend(red, 100.0)), burst, 2000.0)
    r_spaced = simulate(RedundantPolicy(TableBackend(red, 100.0)), spaced, 2000.0)
    assert r_burst.fallbacks == 1 and r_spaced.fallbacks == 0
    assert r_burst.seconds["restart"] == pytest.approx(60.0)
    ob = PolicyTable(tput, reconfiguration_s=5, restart_s=60, f=1)
    o_burst = simulate(OobleckPolicy(TableBackend(ob, 100.0)), burst, 2000.0)
    o_spaced = simulate(OobleckPolicy(TableBackend(ob, 100.0)), spaced, 2000.0)
    assert o_burst.fallbacks == 1 and o_spaced.fallbacks == 0
    assert o_burst.seconds["restart"] == pytest.approx(60.0)
    assert o_spaced.seconds["reconfiguration"] == pytest.approx(10.0)
    ob2 = PolicyTable(tput, reconfiguration_s=5, restart_s=60, f=2)
    assert simulate(OobleckPolicy(TableBackend(ob2, 100.0)), burst, 2000.0).fallbacks == 0


def test_too_few_nodes_stops_and_an_arrival_restarts():
    table = PolicyTable({3: 30.0}, restart_s=40, reconfiguration_s=2)
    nodes = ("a", "b", "c")
    trace = Trace(nodes, (TraceEvent(100.0, "fail", "a"), TraceEvent(400.0, "add", "z")))
    r = simulate(RestartPolicy(TableBackend(table, 30.0)), trace, 1000.0)
    assert r.seconds["stopped"] == pytest.approx(300.0)
    assert r.seconds["restart"] == pytest.approx(40.0)
    o = simulate(OobleckPolicy(TableBackend(table, 30.0)), trace, 1000.0)
    assert o.seconds["stopped"] == pytest.approx(300.0) and o.fallbacks == 1


def test_paper_preset_reproduces_the_published_shares():
    """Oobleck artifact, BERT-large, 30 nodes, a failure every 10 minutes: 95.5 / 54.4 / 15.0 %."""
    s = load_scenario(PAPER)
    duration = s.duration_hours * 3600
    trace = fixed_interval(node_names(s.nodes), 60 * s.every_minutes, duration, seed=0)
    assert trace.failures == 14
    res = run_policies(scenario_backends(s), trace, duration)
    _check_accounting(res, duration, s.samples_per_iteration)
    published = {"oobleck": 0.955, "restart": 0.544, "redundant": 0.150}
    for name, share in published.items():
        assert abs(res[name].shares["effective"] - share) <= 0.05, (name, res[name].shares)
    # Which node fails does not matter to a table: any seed gives the same shares.
    other = run_policies(scenario_backends(s), fixed_interval(node_names(30), 600, duration, 5),
                         duration)
    assert {k: v.seconds for k, v in other.items()} == {k: v.seconds for k, v in res.items()}


def test_trace_files(tmp_path):
    csv_h = tmp_path / "a.csv"
    csv_h.write_text("time,event,node\n0,add,n1\n0,add,n2\n0,add,n3\n60,fail,n2\n90.5,add,n9\n")
    t = load_trace(csv_h)
    assert t.nodes == ("n1", "n2", "n3")
    assert t.events == (TraceEvent(60.0, "fail", "n2"), TraceEvent(90.5, "add", "n9"))
    art = tmp_path / "art.csv"  # the Oobleck artifact's format: ms, 'remove'
    art.write_text("0,add,node1\n0,add,node2\n601200,remove,node1\n")
    t = load_trace(art, time_unit="ms")
    assert t.nodes == ("node1", "node2") and t.events == (TraceEvent(601.2, "fail", "node1"),)
    jl = tmp_path / "b.jsonl"
    jl.write_text('{"time": 5, "event": "fail", "node": "node0"}\n\n'
                  '{"time": 2, "event": "add", "node": "x"}\n')
    t = load_trace(jl, nodes=node_names(4))
    assert t.nodes == node_names(4) and [e.time_s for e in t.events] == [2.0, 5.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,event,node\n0,add,n1\n5,explode,n1\n")
    with pytest.raises(ConfigError) as e:
        load_trace(bad)
    assert "bad.csv" in str(e.value) and "line 3" in str(e.value) and "explode" in str(e.value)
    neg = tmp_path / "neg.csv"
    neg.write_text("time,event,node\n0,add,n1\n-3,fail,n1\n")
    with pytest.raises(ConfigError, match="line 3"):
        load_trace(neg)
    with pytest.raises(ConfigError, match="no initial nodes"):
        load_trace(_write(tmp_path / "c.csv", "5,fail,n\n"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_scenario_errors_name_key_and_fix(tmp_path):
    p = _write(tmp_path / "s.yaml", "simulation:\n  nodes: 4\n  samples_per_iteration: 8\n"
               "  oobleck: {throughput: {4: 1.0}, reconfig_s: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_scenario(p)
    assert "simulation.oobleck.reconfig_s" in str(e.value) and "reconfiguration_s" in str(e.value)
    p = _write(tmp_path / "t.yaml", "simulation:\n  nodes: 4\n  samples_per_iteration: 8\n"
               "  redundant: {throughput: {4: 1.0}, useful: 1.5}\n")
    with pytest.raises(ConfigError, match="useful"):
        load_scenario(p)


def test_cli_table_json_and_errors(tmp_path, capsys):
    import argparse

    from oobleck_hpc.sim import cli

    def run(*argv):
        parser = argparse.ArgumentParser()
        cli.register(parser.add_subparsers())
        args = parser.parse_args(["simulate", *argv])
        return args.func(args)

    assert run(str(PAPER)) == 0
    out = capsys.readouterr().out
    assert "oobleck" in out and "restart" in out and "redundant" in out and "14 failures" in out
    assert run(str(PAPER), "--json", "--policies", "oobleck,restart", "--every", "30") == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["policies"]) == {"oobleck", "restart"} and data["meta"]["failures"] == 4
    for r in data["policies"].values():
        assert math.isclose(sum(r["seconds"].values()), 9000.0)
    with pytest.raises(ConfigError, match="--policies"):
        run(str(PAPER), "--policies", "oobleck,magic")
    png = tmp_path / "t.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert run(str(PAPER), "--plot", str(png)) == 2
        assert "matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert run(str(PAPER), "--plot", str(png)) == 0 and png.stat().st_size > 0


def _cli(*argv):
    import argparse

    from oobleck_hpc.sim import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_cli_plot_writes_a_png_of_goodput(tmp_path, capsys):
    png = tmp_path / "goodput.png"
    assert _cli(str(PAPER), "--plot", str(png)) == 0
    out = capsys.readouterr().out
    assert f"plot written to {png}" in out
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 400
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (height, width)  # decodes
    assert [p.name for p in tmp_path.iterdir()] == ["goodput.png"]  # no temporary left
    # --json keeps stdout pure JSON
    svg = tmp_path / "goodput.svg"
    assert _cli(str(PAPER), "--json", "--plot", str(svg)) == 0
    json.loads(capsys.readouterr().out)
    assert svg.read_text().lstrip().startswith("<?xml")


def test_cli_plot_title_names_job_and_failure_rate_once(tmp_path, monkeypatch):
    from oobleck_hpc.sim import report

    seen = {}
    monkeypatch.setattr(report, "plot", lambda results, path, *a: seen.update(
        results=results, path=path, args=a))
    assert _cli(str(PAPER), "--every", "30", "--plot", str(tmp_path / "p.png")) == 0
    job, rate, fails, joins = seen["args"]
    assert job == "bert-large-paper, 30 nodes, global batch 8192 samples"
    assert rate == "one failure every 30 min: 4 failures in 2.5 h simulated"
    assert fails == [1800.0, 3600.0, 5400.0, 7200.0] and joins == []
    fig = report.goodput_figure(seen["results"], job, rate, fails, joins)
    top, bottom = fig.axes
    assert fig.get_suptitle() == f"Goodput under failures: {job}\n{rate}"
    assert "samples/s" in top.get_ylabel() and "samples" in bottom.get_ylabel()
    assert bottom.get_xlabel() == "simulated time (hours)"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [x.split(":")[0] for x in labels] == [
        "oobleck (in-place reconfiguration)", "checkpoint-restart", "redundant computation",
        "node failure (4)"]
    assert "thrown away" in fig.legends[0].get_title().get_text()


@pytest.mark.parametrize("where, expect", [
    ("missing/dir/p.png", "does not exist"),
    ("a-file.txt/p.png", "is not a directory"),
    (".", "is a directory"),
    ("p.jpg", "unknown format '.jpg'"),
    ("p", "unknown format '(no suffix)'"),
])
def test_cli_plot_path_is_checked_before_anything_is_printed(tmp_path, capsys, where, expect):
    (tmp_path / "a-file.txt").write_text("x")
    target = tmp_path / where
    assert _cli(str(PAPER), "--plot", str(target)) == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # no table first
    assert f"--plot {target}" in cap.err and expect in cap.err and "Fix:" in cap.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file.txt"]


def _small_job():
    from oobleck_hpc.config import job_from_dict

    return job_from_dict({
        "name": "sim-small", "model": {"name": "gpt3-350m", "dtype": "bfloat16"},
        "train": {"microbatch_size": 1, "global_microbatches": 32},
        "cluster": {"nodes": 8, "gpus_per_node": 2, "device": "cuda"},
        "fault_tolerance": {"f": 1},
        "profile": {"analytic": True, "device": "A100-80G"}})


def test_planner_driven_run_on_a_small_analytic_case():
    from oobleck_hpc.planning.cost import plan_iteration_ms
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.sim.planner_backend import CostParams, PlannerModel, planner_backends

    job = _small_job()
    profile = resolve_profile(job)
    duration = 6 * 3600.0
    trace = fixed_interval(node_names(8), 3600.0, duration, seed=3)
    assert trace.failures == 5
    params = CostParams(regroup_s=1.5, restart_base_s=100.0)
    res = run_policies(planner_backends(job, profile, params,
                                        trace.mean_failure_interval_s(duration)),
                       trace, duration)
    _check_accounting(res, duration, 32)
    ob, rs, rd = res["oobleck"], res["restart"], res["redundant"]
    # oobleck: five in-place reconfigurations, each at least detection + regroup
    assert ob.fallbacks == 0 and ob.failures == 5
    assert ob.seconds["reconfiguration"] >= 5 * (job.fault_tolerance.lease_s + 1.5) - 1e-9
    assert ob.seconds["restart"] == 0
    # restart: every failure goes back to the checkpoint and pays a restart
    assert rs.fallbacks == 5 and rs.seconds["restart"] >= 5 * 100.0
    assert rs.seconds["checkpoint"] > 0
    assert rd.seconds["redundant"] > 0
    assert ob.shares["effective"] > rs.shares["effective"] > 0
    # the first segment runs at the throughput of the planner's initial plan
    model = PlannerModel(job, profile, params)
    it_s = plan_iteration_ms(model.initial_plan, profile) / 1000.0
    assert ob.timeline[0][2] == pytest.approx(32 / it_s)
    # and fewer nodes after failures never train faster than the full cluster
    assert max(rate for _, _, rate in ob.timeline) == pytest.approx(32 / it_s)


def test_replacements_keep_the_cluster_size_and_cost_no_extra_restarts():
    nodes = node_names(6)
    trace = fixed_interval(nodes, 600.0, 6000.0, seed=2, replace_after_s=300.0)
    kinds = [e.kind for e in trace.events]
    assert kinds.count("fail") == 9 and kinds.count("add") == 9
    s = _scenario(6)
    res = run_policies(scenario_backends(s), trace, 6000.0)
    _check_accounting(res, 6000.0, s.samples_per_iteration)
    # restart takes a joining node only at its next restart: one restart per failure
    assert res["restart"].seconds["restart"] == pytest.approx(9 * 30.0)
    # oobleck absorbs each failure and each arrival in place: 18 reconfigurations of 2 s
    assert res["oobleck"].seconds["reconfiguration"] == pytest.approx(18 * 2.0)
    assert res["oobleck"].seconds["idle"] == pytest.approx(0.0)


def test_example_traces_replay():
    s = load_scenario(PAPER)
    replay = load_trace(ROOT / "examples" / "traces" / "every-10min-30nodes.csv")
    generated = fixed_interval(node_names(30), 600.0, 9000.0, seed=0)
    assert replay.nodes == generated.nodes and replay.events == generated.events
    jl = load_trace(ROOT / "examples" / "traces" / "mtbf-1h-128nodes-replaced.jsonl",
                    nodes=node_names(128))
    assert jl.failures > 10 and any(e.kind == "add" for e in jl.events)
    res = run_policies(scenario_backends(s), replay, 9000.0)
    assert res["oobleck"].failures == 14


def test_growth_compares_shrinking_spares_and_replacements_on_the_same_failures(tmp_path, capsys):
    """--growth: the oobleck policy on one trace three ways. Arrivals only add to the trace (the
    failures are the same); spares answer the first S losses at once, replacements every loss
    later; more nodes never train less, and a job that shrinks below its plan stops."""
    import yaml

    trace = fixed_interval(node_names(8), 3600.0, 12 * 3600.0, seed=3)
    spared = trace.with_arrivals(3.0, 2)
    assert [e for e in spared.events if e.kind == "fail"] == list(trace.events)
    assert [(e.time_s, e.node) for e in spared.events if e.kind == "add"] == [
        (3603.0, "new1"), (7203.0, "new2")]
    assert len(trace.with_arrivals(600.0).events) == 2 * trace.failures
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_small_job().to_dict()))
    assert _cli(str(job), "--every", "60", "--duration", "12", "--growth", "--spares", "2",
                "--replace-after", "10", "--json") == 0
    data = json.loads(capsys.readouterr().out)["policies"]
    shrink, spares, replaced = (data[k] for k in (
        "oobleck, shrink only", "oobleck, 2 spares", "oobleck, replaced after 10 min"))
    # one an hour for 12 h, but the 8 nodes are all gone after 8 (arrivals are never victims)
    assert shrink["failures"] == spares["failures"] == replaced["failures"] == 8
    assert shrink["samples"] < spares["samples"] < replaced["samples"]
    assert shrink["seconds"]["stopped"] > 0 and replaced["seconds"]["stopped"] == 0
    with pytest.raises(ConfigError, match="--spares"):
        _cli(str(job), "--every", "60", "--growth", "--spares", "-1")
