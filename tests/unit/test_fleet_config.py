"""The fleet file: strict loading (errors that name the file, the key, the value and the fix),
each job's curve from its own planner, and `oobleck-hpc fleet plan` on the bundled example."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oobleck_hpc import cli
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.fleet.config import MTBF_HOURS, TRANSITION_S, load_fleet

EXAMPLES = Path(__file__).parents[2] / "examples"
TINY = EXAMPLES / "fleet-tiny-local.yaml"


def test_the_example_fleet_loads_with_its_jobs_resolved_against_its_folder():
    fleet, jobs = load_fleet(TINY)
    assert fleet.pool.nodes == 8 and fleet.mtbf_hours == MTBF_HOURS
    assert [j.name for j in jobs] == ["gpt-tiny-local", "llama-tiny-local", "gpt-tiny-ablation"]
    assert [j.entry.weight for j in jobs] == [4, 2, 1]
    assert jobs[0].entry.transition_s == TRANSITION_S and jobs[2].entry.max_nodes == 4
    assert load_fleet(TINY, nodes=12)[0].pool.nodes == 12


@pytest.mark.parametrize("text, key, words", [
    ("pool: {nodes: 4}\njobs: []\n", "jobs", "list at least one job"),
    ("jobs:\n  - job: JOB\n", "pool", "required but missing"),
    ("pool: {nodes: 0}\njobs:\n  - job: JOB\n", "pool.nodes", "at least 1"),
    ("pool: {nodes: 4, slurm: true}\njobs:\n  - job: JOB\n", "pool.slurm", "valid keys here are: nodes"),
    ("pool: {nodes: 4}\njobs:\n  - {job: JOB, weigth: 2}\n", "jobs[0].weigth",
     "valid keys here are: job, weight, name, min_nodes, max_nodes, transition_s"),
    ("pool: {nodes: 4}\njobs:\n  - {job: JOB, weight: 0}\n", "jobs[0].weight", "must be > 0"),
    ("pool: {nodes: 4}\njobs:\n  - {job: JOB, min_nodes: 3, max_nodes: 2}\n", "jobs[0].max_nodes",
     "below min_nodes"),
    ("pool: {nodes: 4}\njobs:\n  - {job: JOB, transition_s: -1}\n", "jobs[0].transition_s", ">= 0"),
    ("pool: {nodes: 4}\nmtbf_hours: 0\njobs:\n  - job: JOB\n", "mtbf_hours", "must be > 0"),
    ("pool: {nodes: 4}\njobs:\n  - job: nowhere.yaml\n", "jobs[0].job", "relative to"),
    ("pool: {nodes: 4}\njobs:\n  - job: JOB\n  - job: JOB\n", "jobs[1]", "own 'name:'"),
    ("pool: {nodes: 4}\njobs: {job: JOB}\n", "jobs", "not a list"),
])
def test_bad_fleet_files_are_explained(tmp_path, text, key, words):
    path = tmp_path / "fleet.yaml"
    path.write_text(text.replace("JOB", str(EXAMPLES / "gpt-tiny-local.yaml")))
    with pytest.raises(ConfigError) as e:
        load_fleet(path)
    assert e.value.source == str(path) and e.value.key == key
    assert words in str(e.value)


def test_a_job_curve_is_its_planner_throughput_times_its_flops():
    from oobleck_hpc.fleet.curves import flops_per_sample, job_curve

    _, jobs = load_fleet(TINY)
    curve = job_curve(jobs[0], 8)
    assert len(curve.samples_per_s) == 9 and curve.samples_per_s[0] == 0
    assert curve.smallest == 2  # f = 1: two pipelines of one node
    assert curve.samples_per_s[1] == 0 and curve.samples_per_s[8] > curve.samples_per_s[2] > 0
    assert curve.flops_per_sample == flops_per_sample(jobs[0].job) > 0
    np.testing.assert_allclose(curve.waf, 4 * curve.samples_per_s * curve.flops_per_sample)
    assert len(job_curve(jobs[2], 8).samples_per_s) == 5  # max_nodes: 4


def test_fleet_plan_prints_the_allocation_and_its_json_adds_up(capsys):
    assert cli.main(["fleet", "plan", str(TINY), "--nodes", "8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["nodes"] == 8 and sum(j["nodes"] for j in rep["jobs"]) + rep["idle_nodes"] == 8
    assert rep["total_waf"] == pytest.approx(sum(j["waf"] for j in rep["jobs"]))
    for j in rep["jobs"]:
        assert j["waf"] == pytest.approx(j["weight"] * j["flops_per_s"])
        assert j["flops_per_s"] == pytest.approx(j["samples_per_s"] * j["flops_per_sample"])
    assert cli.main(["fleet", "plan", str(TINY), "--current",
                     "gpt-tiny-local=2,llama-tiny-local=2,gpt-tiny-ablation=4"]) == 0
    out = capsys.readouterr().out
    assert "total WAF" in out and "WAF now" in out
    assert cli.main(["fleet", "plan", str(TINY), "--current", "nobody=3"]) == 2
    assert "the jobs are: gpt-tiny-local" in capsys.readouterr().err


def test_current_counts_name_the_jobs_and_a_job_not_named_waits():
    from oobleck_hpc.fleet.cli import parse_current

    assert parse_current(None, ["a", "b"]) == {}
    assert parse_current("b=3", ["a", "b"]) == {"a": 0, "b": 3}
    with pytest.raises(ConfigError, match="the jobs are: a, b"):
        parse_current("a=x", ["a", "b"])


def test_flops_per_sample_is_six_times_parameters_times_tokens_plus_attention():
    from oobleck_hpc.profiling.analytic import training_flops_per_sample

    # GPT-3 6.7B: 6 N s with N = 6.7e9, s = 2048, and attention's 12 n_layer d s^2 on top
    assert training_flops_per_sample("gpt3-6.7b") == pytest.approx(6 * 6.7e9 * 2048, rel=0.1)
    # half the tokens: half the dense FLOPs, a quarter of attention's
    assert training_flops_per_sample("gpt3-6.7b", seq_len=1024) < \
        training_flops_per_sample("gpt3-6.7b") / 2
