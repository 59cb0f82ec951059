"""`oobleck-hpc chaos`: the fault-set generator (pure: reproducible, covers what it claims), the
expected outcome against a brute force on the plan, and one small seeded campaign end to end
(real local jobs, compared with the fp64 single-process reference)."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml

from oobleck_hpc.operate.chaos import KILL_GRACE_S, KINDS, PHASES, check_steps, draw_campaign, trial_job
from oobleck_hpc.operate.chaos_oracle import (RECOVERY_PHASES, START_PHASES, STEP_PHASES,
                                      expected_outcomes, has_quorum, judge, positions,
                                      quorum_ways, rejoins, round_orders)
from oobleck_hpc.config import FaultConfig, job_from_dict
from oobleck_hpc.errors import GuaranteeExceeded
from oobleck_hpc.planning.instantiate import instantiate
from oobleck_hpc.planning.reconfigure import reconfigure
from oobleck_hpc.planning.spec import node_specification
from oobleck_hpc.planning.templates import build_templates
from test_planning_templates import random_profile

ROOT = Path(__file__).resolve().parents[1]


def test_same_seed_same_trials_and_trials_independent_of_count():
    a = draw_campaign(7, 40, nodes=5, steps=12, f=1, kinds=KINDS)
    assert a == draw_campaign(7, 40, nodes=5, steps=12, f=1, kinds=KINDS)
    assert a[:10] == draw_campaign(7, 10, nodes=5, steps=12, f=1, kinds=KINDS)
    assert a != draw_campaign(8, 40, nodes=5, steps=12, f=1, kinds=KINDS)


@pytest.mark.parametrize("nodes,steps,f", [(5, 12, 1), (8, 6, 2), (4, 3, 0)])
def test_draws_are_valid_and_cover_nodes_steps_phases_kinds_counts(nodes, steps, f):
    sets = draw_campaign(1, 600, nodes=nodes, steps=steps, f=f, kinds=KINDS)
    seen = Counter()
    for faults in sets:
        # every set is a valid `faults:` list of a job with these nodes and steps
        job_from_dict({"cluster": {"nodes": nodes}, "train": {"steps": steps},
                       "fault_tolerance": {"f": f},
                       "faults": [vars(x) for x in faults]})
        assert len({x.node for x in faults}) == len(faults), faults  # distinct nodes
        assert 1 <= len(faults) <= nodes - 1
        first = faults[0]
        assert first.phase not in RECOVERY_PHASES
        for x in faults:
            if x.phase in START_PHASES:
                assert x.step == 1
            if x.phase in RECOVERY_PHASES:  # anchored on an earlier in-step fault
                assert any(y.step == x.step and y.phase in STEP_PHASES for y in faults)
            seen["node", x.node] += 1
            seen["step", x.step] += 1
            seen["phase", x.phase] += 1
            seen["kind", x.kind] += 1
        seen["count", len(faults)] += 1
        seen["beyond"] += len(faults) > f
        seen["later"] += any(x.step > first.step for x in faults[1:])
        seen["simultaneous"] += any((x.step, x.phase) == (first.step, first.phase)
                                    for x in faults[1:])
    assert all(seen["node", n] for n in range(nodes))
    assert seen["step", 1] and seen["step", steps]
    assert all(seen["step", s] for s in range(1, steps + 1))
    assert all(seen["phase", p] for p in PHASES), [p for p in PHASES if not seen["phase", p]]
    assert all(seen["kind", k] for k in KINDS)
    assert all(seen["count", c] for c in range(max(1, f), nodes))  # within f and beyond
    assert seen["beyond"] > 0 and (f == 0 or seen["beyond"] < len(sets))
    if f >= 1:
        assert seen["later"] and seen["simultaneous"]


def test_every_window_is_in_one_class():
    from oobleck_hpc.operate.chaos import AFTER_STEP_PHASES
    classes = START_PHASES + STEP_PHASES + RECOVERY_PHASES + AFTER_STEP_PHASES
    assert sorted(classes) == sorted(PHASES)


def test_kinds_restrict_the_draw():
    sets = draw_campaign(3, 100, nodes=5, steps=12, f=1, kinds=["kill"])
    assert {x.kind for s in sets for x in s} == {"kill"}


def test_round_orders_follow_time_and_count_both_ways_of_a_race():
    F = FaultConfig
    start, step = F(4, 1, "rendezvous"), F(1, 3, "backward")
    recon, transfer = F(2, 3, "reconfiguration"), F(0, 3, "transfer")
    # one order: start, step 3's failure, then one round per recovery phase
    assert round_orders([transfer, step, start, recon]) == [
        [(-1.0, [start]), (3.0, [step]), (3.1, [recon]), (3.2, [transfer])]]
    # a node lost after step 2's commit is noticed during step 3, with step 3's losses
    after = F(3, 2, "commit")
    assert round_orders([after, step]) == [[(3.0, [after, step])]]
    assert round_orders([after]) == [[(2.5, [after])]]
    # the checkpoint after step 3 is as late as step 3's commit
    assert round_orders([F(3, 3, "checkpoint")]) == [[(3.5, [F(3, 3, "checkpoint")])]]
    # a vote fault: the vote failed (a round at its step) or completed elsewhere (later); after
    # the last step, the loss is noticed when the survivors agree they reached the end
    vote = F(3, 5, "vote")
    assert round_orders([vote]) == [[(5.0, [vote])], [(5.5, [vote])]]


def test_quorum_ways_at_once_is_strictest_one_by_one_most_lenient():
    view = ["n0", "n1", "n2", "n3", "n4"]
    brute = {}  # every way to lose the others: ordered splits into rounds, checked round by round

    def ways(v, survivors):
        gone = [n for n in v if n not in survivors]
        if not gone:
            return {True}
        out = set()
        for k in range(1, len(gone) + 1):
            for block in itertools.combinations(gone, k):
                after = [n for n in v if n not in block]
                if not has_quorum(v, after, "majority"):
                    out.add(False)
                else:
                    out |= ways(after, survivors)
        return out

    for k in range(1, len(view)):
        for survivors in itertools.combinations(view, k):
            brute[survivors] = ways(view, list(survivors))
            assert quorum_ways(view, list(survivors), "majority") == brute[survivors], survivors
    assert brute[("n0", "n1", "n2")] == {True}           # a majority at once: every way
    assert brute[("n0", "n1")] == {False, True}          # at once no; one by one yes
    assert brute[("n4",)] == {False}                     # the last node alone: never
    assert quorum_ways(view, ["n4"], "none") == {True}


def _plan(seed: int, memory: int, f: int, extra: int):
    profile = random_profile(random.Random(seed), 10, 2, memory=memory)
    n0 = node_specification(profile, 10, 0).n0
    n = (f + 1) * n0 + extra
    spec = node_specification(profile, n, f)
    templates = build_templates(profile, spec.template_sizes, 4)
    plan = instantiate(templates, [f"node{i}" for i in range(n)], 24, f, profile)
    return profile, templates, plan


def _covered(plan, lost: set[str]) -> bool:
    """Brute force: every layer is in some stage whose node survives."""
    return all(any(s.layer_start <= layer < s.layer_end and p.nodes[s.node] not in lost
                   for p in plan.pipelines for s in p.template.stages)
               for layer in range(plan.num_layers))


# plans of pipelines [2, 1], [3, 2], [2, 2, 2], [3, 2, 2], [5, 4] nodes (n0 = 1, 2, 2, 2, 3)
@pytest.mark.parametrize("seed,memory,f,extra", [
    (4, 10**9, 1, 1), (1, 450_000, 1, 1), (2, 450_000, 1, 3), (0, 450_000, 1, 3),
    (2, 450_000, 2, 0)])
def test_expected_outcome_against_brute_force_on_the_plan(seed, memory, f, extra):
    from oobleck_hpc.recovery.rounds import MAX_ROUNDS

    profile, templates, plan = _plan(seed, memory, f, extra)
    n0, nodes = min(templates), list(plan.nodes)
    outcomes = Counter()
    for k in range(1, len(nodes)):
        for lost in itertools.combinations(range(len(nodes)), k):
            names = {f"node{i}" for i in lost}
            faults = [FaultConfig(i, 2, "backward", "kill") for i in lost]
            outs = expected_outcomes(faults, plan, templates, profile, f, quorum="none")
            if k > MAX_ROUNDS:  # agreed away one by one, they may exhaust a recovery's rounds
                assert "fallback" in outs, (lost, outs)
                outs = [x for x in outs if x != "fallback"] or ["fallback"]
            [got] = outs
            outcomes[got] += 1
            if k <= f:
                assert got == "in_place", (lost, plan)  # the guarantee
            if not _covered(plan, names) or len(nodes) - k < n0:
                assert got == "fallback", (lost, plan)
            else:  # covered: in place unless the planner has no plan for the survivors
                try:
                    reconfigure(plan, names, templates, profile, f)
                    assert got == "in_place", (lost, plan)
                except GuaranteeExceeded:
                    assert got == "fallback", (lost, plan)
    assert outcomes["in_place"] and outcomes["fallback"]


def test_expected_outcome_falls_back_without_a_quorum():
    """Losing more than half of the view in one round leaves no majority: the survivors fall
    back although every layer kept a replica; one by one they go on. Nodes failing in the same
    window may go either way; all but the view's last node can only fall back."""
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    nodes = list(plan.nodes)
    half = [FaultConfig(i, 2, "backward", "kill") for i in range(len(nodes) // 2 + 1)]
    assert _covered(plan, {f"node{x.node}" for x in half})
    assert expected_outcomes(half, plan, templates, profile, 1) == ["fallback", "in_place"]
    assert expected_outcomes(half, plan, templates, profile, 1, quorum="none") == ["in_place"]
    all_but_last = [FaultConfig(i, 2, "backward", "kill") for i in range(len(nodes) - 1)]
    assert _covered(plan, {f"node{x.node}" for x in all_but_last})
    assert expected_outcomes(all_but_last, plan, templates, profile, 1) == ["fallback"]
    # the same nodes lost one round after the other (the 2nd and 3rd while the survivors
    # reconfigure): each round keeps a majority of the view before it
    assert len(half) == 3
    rounds = [FaultConfig(x.node, 2, phase, "kill")
              for x, phase in zip(half, ("backward", *RECOVERY_PHASES))]
    assert expected_outcomes(rounds, plan, templates, profile, 1) == ["in_place"]
    n = len(nodes)
    assert has_quorum(nodes, nodes[:n // 2 + 1], "majority")
    assert not has_quorum(nodes, nodes[n // 2 + 1:], "majority")
    if n % 2 == 0:  # exactly half: only with the view's first node
        assert has_quorum(nodes, nodes[:n // 2], "majority")
        assert not has_quorum(nodes, nodes[n // 2:], "majority")


def test_expected_outcome_follows_the_plan_across_recoveries():
    """A second episode is judged on the plan after the first recovery: losing the nodes one by
    one (each a later step) never falls back while a replica of every layer is left."""
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    nodes = len(plan.nodes)
    one_by_one = [FaultConfig(i, i + 1, "forward", "kill") for i in range(nodes - 1)]
    assert expected_outcomes(one_by_one[:1], plan, templates, profile, 1) == ["in_place"]
    current, expected = plan, "in_place"
    for x in one_by_one:
        try:
            current = reconfigure(current, {f"node{x.node}"}, templates, profile, 1)
        except GuaranteeExceeded:
            expected = "fallback"
            break
    assert expected_outcomes(one_by_one, plan, templates, profile, 1, quorum="none") == [expected]


def test_a_drain_is_taken_only_where_the_verdict_accepts_it():
    """A drain leaves after the commit of any step from its own on, or never; it is refused
    (nothing changes) where the others could not go on without it, so drains alone never fall
    back. Beside kills it takes part in the guarantee: draining a node, then losing the rest of
    what the drain left, is judged on the plan without the drained node."""
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    nodes = list(plan.nodes)
    d = FaultConfig(1, 4, "forward", "drain")
    assert round_orders([d], steps=5) == [[(4.45, [d])], [(5.45, [d])], [(math.inf, [d])]]
    every = [FaultConfig(i, 2, "forward", "drain") for i in range(len(nodes))]
    assert expected_outcomes(every, plan, templates, profile, 1, steps=3) == ["in_place"]
    # a drain, then a kill: in place exactly when the planner goes on without both, from the
    # plan without the drained node (where the drain was accepted)
    for i, j in itertools.permutations(range(len(nodes)), 2):
        faults = [FaultConfig(i, 2, "forward", "drain"), FaultConfig(j, 3, "backward", "kill")]
        got = expected_outcomes(faults, plan, templates, profile, 1, steps=3)
        try:
            after_drain = reconfigure(plan, {f"node{i}"}, templates, profile, 1)
        except GuaranteeExceeded:
            after_drain = None  # refused: only the kill counts
        try:
            reconfigure(after_drain or plan, {f"node{j}"}, templates, profile, 1)
            both = "in_place"
        except GuaranteeExceeded:
            both = "fallback"
        assert both in got, (i, j, got)
        # a trial's tail of steps: the drain may leave after any of 30; judged on every order
        # uncut, the outcomes are those of the orders cut after the last fault
        uncut = set().union(*(judge(order, plan, templates, profile, 1)
                              for order in round_orders(faults, 30)))
        assert expected_outcomes(faults, plan, templates, profile, 1, steps=30) == sorted(uncut)


def test_a_crashed_worker_costs_its_node_which_rejoins_once_a_step_committed():
    """A crash costs its node's place like a kill (control/agent.py: the node steps out at
    once); once a step committed on the node, it comes back -- a node more, as a grown one, so
    in place is expected where the losses alone would fall back."""
    F = FaultConfig
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    late, early, racy = F(1, 3, "forward", "crash"), F(1, 1, "forward", "crash"), F(1, 1, "vote", "crash")
    assert round_orders([late]) == [[(3.0, [late])]]
    assert round_orders([early]) == [[(1.0, [early])]]
    assert round_orders([racy]) == [[(1.0, [racy])], [(1.5, [racy])]]
    assert round_orders([F(2, 1, "rendezvous", "crash")]) == [[(-1.0, [F(2, 1, "rendezvous", "crash")])]]
    assert [rejoins(x) for x in (late, early, racy)] == [True, False, True]
    # nodes lost at once beyond what the plan survives: killed, the job falls back; crashed,
    # they come back, and in place is possible too
    beyond = next(c for k in range(2, len(plan.nodes))
                  for c in itertools.combinations(range(len(plan.nodes)), k)
                  if expected_outcomes([F(i, 2, "backward", "kill") for i in c], plan, templates,
                                       profile, 1) == ["fallback"])
    crashes = [F(i, 2, "backward", "crash") for i in beyond]
    assert expected_outcomes(crashes, plan, templates, profile, 1) == ["fallback", "in_place"]
    assert expected_outcomes(crashes[:1], plan, templates, profile, 1) == ["in_place"]


def test_trial_job_is_fp64_with_its_own_dirs_and_faults(tmp_path):
    base = job_from_dict({"name": "x", "cluster": {"nodes": 5}, "train": {"steps": 40},
                          "checkpoint": {"dir": "/elsewhere", "every_steps": 10}})
    faults = [FaultConfig(2, 3, "vote", "hang")]
    d = trial_job(base, faults, tmp_path / "trial-000", steps=6, checkpoint_every=2)
    job = job_from_dict(yaml.safe_load(yaml.safe_dump(d)))
    assert job.model.dtype == "float64" and job.train.save_final_params
    assert job.train.steps == 6 and job.faults == faults
    assert job.run_dir == str(tmp_path / "trial-000" / "run")
    assert job.checkpoint.dir == str(tmp_path / "trial-000" / "ckpt")
    assert job.checkpoint.every_steps == 2
    assert job.cluster.kill_grace_s == KILL_GRACE_S  # a short tail outlives it twice


def test_steps_are_complete_only_with_every_step_once_per_attempt():
    rows = [{"step": k, "attempt": 0} for k in (1, 2, 3)]
    assert check_steps(rows, 3)
    assert not check_steps(rows[:2], 3)                     # a silent end: step 3 missing
    assert not check_steps(rows + [{"step": 3, "attempt": 0}], 3)   # twice in one attempt
    assert check_steps(rows[:2] + [{"step": k, "attempt": 1} for k in (2, 3)], 3)  # replayed
    assert not check_steps(rows + [{"step": 4, "attempt": 0}], 3)


def test_as_many_faults_at_one_step_as_a_recovery_has_rounds_may_fall_back():
    """Chaos seed 20261126, trial 13: a grow and a crash in step 12's prepared window, a hang
    while the survivors reconfigure, an exit during the transfer: four rounds in the recovery
    of one step, and the ranks that counted MAX_ROUNDS failed rounds fell back -- as
    recovery/rounds.py bounds a recovery. In place stays possible (one by one, every round
    keeps the quorum and a replica of every layer). Three faults at one step do not."""
    from oobleck_hpc.operate.chaos_oracle import rounds_at_one_step
    from oobleck_hpc.recovery.rounds import MAX_ROUNDS

    F = FaultConfig
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    trial13 = [F(1, 12, "prepared", "grow"), F(4, 12, "reconfiguration", "hang"),
               F(0, 12, "prepared", "crash"), F(3, 12, "transfer", "exit")]
    assert rounds_at_one_step(trial13) == 4 > MAX_ROUNDS
    assert expected_outcomes(trial13, plan, templates, profile, 1, steps=30) == [
        "fallback", "in_place"]
    three = [F(4, 12, "backward", "kill"), F(3, 12, "transfer", "kill"),
             F(2, 12, "prepared", "crash")]
    assert rounds_at_one_step(three) == 3
    assert expected_outcomes(three, plan, templates, profile, 1, steps=30) == ["in_place"]
    spread = [F(1, 3, "backward", "crash"), F(2, 5, "forward", "kill"),
              F(3, 8, "vote", "exit")]  # one round each, in three recoveries
    assert rounds_at_one_step(spread) == 1


def test_a_grow_never_costs_a_node_and_may_keep_a_fallback_in_place():
    """A grown node joins after a loss when it started in time: the set's fallback may then be
    in place (`expected_outcomes`); on its own a grow is in place."""
    F = FaultConfig
    profile, templates, plan = _plan(0, 10**9, 1, 3)
    assert positions(F(1, 3, "forward", "grow"), 12) == (math.inf,)
    assert expected_outcomes([F(1, 3, "forward", "grow")], plan, templates, profile, 1) == [
        "in_place"]
    beyond = [F(i, 2, "backward", "kill") for i in range(len(plan.nodes) - 1)]
    assert expected_outcomes(beyond, plan, templates, profile, 1) == ["fallback"]
    assert expected_outcomes(beyond + [F(len(plan.nodes) - 1, 1, "forward", "grow")], plan,
                             templates, profile, 1) == ["fallback", "in_place"]


def _live_group_members(groups: set[int]) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.timeout(600)
def test_small_seeded_campaign_of_kills(tmp_path, capsys):
    """Three seeded trials of kills on the 5-node gpt-tiny job, drawn in 4 steps, then 150 more
    (seed 727: node0, the store host, at step 0; two nodes at step 3, the second while the
    survivors reconfigure, beyond f = 1; another node at step 0): every trial ends as expected
    with final parameters equal to the fp64 reference, every step once, a finished record, and
    leaves no process."""
    from oobleck_hpc.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "chaos-test",
        "model": {"name": "gpt-tiny", "seed": 0},
        "train": {"steps": 4, "microbatch_size": 2, "global_microbatches": 4, "lr": 1e-3,
                  "warmup_steps": 1, "log_every": 1},
        "cluster": {"launch": "local", "nodes": 5, "gpus_per_node": 2, "device": "cpu"},
        "fault_tolerance": {"f": 1, "collective_timeout_s": 5.0, "heartbeat_s": 0.5,
                            "lease_s": 3.0},
        "profile": {"library": str(ROOT / "profiles")}}))
    out = tmp_path / "campaign"
    code = main(["chaos", str(job), "--trials", "3", "--seed", "727", "--kinds", "kill",
                 "--steps", "4", "--tail-steps", "150", "--trial-timeout", "150",
                 "--out", str(out), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads((out / "result.json").read_text()) and result["complete"]
    assert len(result["trials"]) == 3
    for t in result["trials"]:
        assert {x["kind"] for x in t["faults"]} == {"kill"}
        groups = set(json.loads((Path(t["dir"]) / "run" / "agents.json").read_text()).values())
        assert not _live_group_members(groups), f"processes left by {t['dir']}"
        assert t["ok"] and t["outcome"] in t["expected"], (t, f"logs: {t['dir']}/out.log")
        assert t["max_rel_diff"] is not None and t["max_rel_diff"] <= 1e-9, t
        # every step once, the record finished, trained on past every grace period twice
        assert t["steps_complete"] and t["finished"] and not t["short_tail"], t
        assert t["recovery_s"] or not t["fired"], t
        # a requeue counts as a fallback: the observer agrees with what the console told
        told = (Path(t["dir"]) / "out.log").read_text().count("\nrequeued: attempt ")
        assert t["requeues"] == told and (t["outcome"] == "fallback") == (told > 0), t
    assert code == 0
    s = result["summary"]
    assert s["within_f"] + s["beyond_f"] == 3
    assert s["in_place_exact"] + s["fallback_exact"] == 3
