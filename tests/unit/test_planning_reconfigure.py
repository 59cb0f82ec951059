"""Reconfiguration: the new plan covers exactly the survivors with valid templates, beyond the
guarantee raises GuaranteeExceeded, and the transfer plan gives every GPU exactly the layers it
lacks, from surviving replicas, in the new plan's rank space, balanced across nodes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from oobleck_hpc.errors import GuaranteeExceeded, PlanningError
from oobleck_hpc.planning import cost
from oobleck_hpc.planning.instantiate import build_plan, instantiate
from oobleck_hpc.planning.reconfigure import _keep_groups, reconfigure, transfer_plan
from oobleck_hpc.planning.spec import node_specification
from oobleck_hpc.planning.templates import build_templates
from test_planning_templates import random_profile


def _setup(seed: int, extra: int, f: int, memory: int = 10**9, L: int = 12, G: int = 2):
    profile = random_profile(random.Random(seed), L, G, memory=memory)
    n0 = node_specification(profile, L, 0).n0
    N = (f + 1) * n0 + extra
    spec = node_specification(profile, N, f)
    templates = build_templates(profile, spec.template_sizes, 4)
    plan = instantiate(templates, [f"n{i}" for i in range(N)], 48, f, profile)
    return profile, templates, plan


def _holds(plan, node, gpu):
    for r in plan.ranks:
        if r.node == node and r.local_gpu == gpu:
            return set(range(r.layer_start, r.layer_end))
    return set()


def check_transfers(old, new, profile):
    transfers = transfer_plan(old, new, profile)
    got = {(t.layer, t.dst_rank) for t in transfers}
    assert len(got) == len(transfers)
    want = set()
    for r in new.ranks:
        had = _holds(old, r.node, r.local_gpu)
        want |= {(l, r.rank) for l in range(r.layer_start, r.layer_end) if l not in had}
    assert got == want
    for t in transfers:
        src = new.ranks[t.src_rank]  # a survivor, in the new rank space
        assert t.layer in _holds(old, src.node, src.local_gpu)
        lay = profile.layers[t.layer]
        assert t.nbytes == lay.param_bytes + lay.optimizer_bytes
    return transfers


@pytest.mark.parametrize("seed", range(8))
def test_reconfigure_after_up_to_f_losses(seed):
    rng = random.Random(100 + seed)
    f = rng.randint(1, 3)
    profile, templates, plan = _setup(seed, rng.randint(0, 8), f, memory=rng.choice([10**9, 450_000]))
    n0 = min(templates)
    current = plan
    for _ in range(f):
        lost = rng.sample(list(current.nodes), 1)
        if len(current.nodes) - 1 < n0:
            break
        try:
            new = reconfigure(current, lost, templates, profile, f)
        except GuaranteeExceeded:
            continue  # every replica of some layer was on the lost node
        assert new.generation == current.generation + 1
        assert sorted(new.nodes) == sorted(set(current.nodes) - set(lost))
        assert sum(p.microbatches for p in new.pipelines) == current.global_microbatches
        assert all(p.template is templates[len(p.nodes)] for p in new.pipelines)
        assert new.predicted_iteration_ms == pytest.approx(cost.plan_iteration_ms(new, profile))
        assert len(new.ranks) == new.world_size
        check_transfers(current, new, profile)
        current = new


def test_keeps_untouched_pipelines_and_moves_few_bytes():
    profile, templates, plan = _setup(1, 9, 2, L=10, G=1)
    victim = plan.pipelines[0].nodes[-1]
    new = reconfigure(plan, [victim], templates, profile, 2)
    transfers = check_transfers(plan, new, profile)
    # at most the layers of the damaged pipeline(s) move
    moved_layers = {(t.dst_rank) for t in transfers}
    assert len(moved_layers) <= len(new.nodes)
    again = reconfigure(plan, [victim], templates, profile, 2)
    assert again.digest() == new.digest()


def test_layer_lost_everywhere_raises():
    # two pipelines of the same 2-node template: the first node of each holds the same layers
    profile = random_profile(random.Random(3), 8, 1, memory=10**9)
    templates = build_templates(profile, [2], 4)
    plan = build_plan(templates, [2, 2], ["a", "b", "c", "d"], 8, profile)
    firsts = [p.nodes[0] for p in plan.pipelines]
    with pytest.raises(GuaranteeExceeded, match="no surviving replica"):
        reconfigure(plan, firsts, templates, profile, 1)


def test_too_few_nodes_raises():
    profile = random_profile(random.Random(3), 8, 1, memory=10**9)
    templates = build_templates(profile, [2, 3], 4)
    plan = build_plan(templates, [2, 2], ["a", "b", "c", "d"], 8, profile)
    with pytest.raises(GuaranteeExceeded, match="fewer than n0 = 2"):
        reconfigure(plan, ["a", "b", "c"], templates, profile, 1)
    with pytest.raises(PlanningError, match="not part of the plan"):
        reconfigure(plan, ["zz"], templates, profile, 1)


def test_undersized_pipeline_borrows_or_merges():
    profile = random_profile(random.Random(9), 12, 1, memory=10**9)
    templates = build_templates(profile, range(2, 7), 4)
    plan = build_plan(templates, [6, 2], [f"n{i}" for i in range(8)], 16, profile)
    small = next(p for p in plan.pipelines if len(p.nodes) == 2)
    lost = {small.nodes[0]}
    # the keep candidate: the 1-node remainder borrows a node from the 6-node pipeline
    groups = _keep_groups(plan, lost, set(templates), 2)
    assert sorted(len(g) for g in groups) == [2, 5]
    assert small.nodes[1] in next(g for g in groups if len(g) == 2)
    # two undersized remainders merge with each other
    plan2 = build_plan(templates, [2, 2, 2], [f"m{i}" for i in range(6)], 16, profile)
    lost2 = {plan2.pipelines[0].nodes[0], plan2.pipelines[1].nodes[0]}
    groups2 = _keep_groups(plan2, lost2, set(templates), 2)
    assert sorted(len(g) for g in groups2) == [2, 2]
    new = reconfigure(plan, lost, templates, profile, 1)
    assert all(len(p.nodes) >= 2 for p in new.pipelines) and len(new.pipelines) >= 2


def test_transfers_are_balanced_across_sources():
    # three identical pipelines; one loses a node: its replacement layers can come from two
    # other pipelines, and the greedy spreads the bytes over both
    profile = random_profile(random.Random(5), 8, 1, memory=10**9)
    templates = build_templates(profile, [3, 4], 4)
    plan = build_plan(templates, [4, 4, 4], [f"n{i}" for i in range(12)], 12, profile)
    new = reconfigure(plan, [plan.pipelines[0].nodes[1]], templates, profile, 2)
    transfers = check_transfers(plan, new, profile)
    cross = [t for t in transfers if new.ranks[t.src_rank].node != new.ranks[t.dst_rank].node]
    if len(cross) >= 2:
        sent: dict[str, int] = {}
        for t in cross:
            sent[new.ranks[t.src_rank].node] = sent.get(new.ranks[t.src_rank].node, 0) + t.nbytes
        assert len(sent) >= 2


@pytest.mark.parametrize("seed", range(6))
def test_joined_nodes_restore_the_first_plans_speed_and_receive_all_their_layers(seed):
    """Lose k <= f nodes, then k new nodes join (in a later generation, or in the same one):
    the plan is as fast as the job's first plan on N nodes (instantiate is exact), every GPU of
    a joined node receives all of its layers from survivors, and a pipeline that kept its nodes
    and template receives nothing."""
    rng = random.Random(200 + seed)
    f = rng.randint(1, 2)
    profile, templates, plan = _setup(seed, rng.randint(0, 6), f)
    lost = rng.sample(list(plan.nodes), f)
    fresh = [f"spare{i}" for i in range(f)]
    shrunk = reconfigure(plan, lost, templates, profile, f)  # f losses: always within the guarantee
    for base, gone in ((shrunk, []), (plan, lost)):
        grown = reconfigure(base, gone, templates, profile, f, joined=fresh)
        assert grown.generation == base.generation + 1
        assert sorted(grown.nodes) == sorted(set(base.nodes) - set(gone) | set(fresh))
        assert grown.predicted_iteration_ms == pytest.approx(plan.predicted_iteration_ms)
        assert sum(p.microbatches for p in grown.pipelines) == plan.global_microbatches
        transfers = check_transfers(base, grown, profile)
        received = {(t.dst_rank, t.layer) for t in transfers}
        kept = {(p.nodes, p.template) for p in base.pipelines}
        for p in grown.pipelines:
            ranks = [r for r in grown.ranks if r.node in p.nodes]
            if (p.nodes, p.template) in kept:
                assert not any(r.rank == d for r in ranks for d, _ in received)
        for r in grown.ranks:
            if r.node in fresh:
                assert {l for d, l in received if d == r.rank} == set(range(r.layer_start, r.layer_end))
    with pytest.raises(PlanningError, match="new to the plan"):
        reconfigure(plan, [], templates, profile, f, joined=[plan.nodes[0]])


# Hand-computed transfers. Four layers whose state (params + AdamW) is 1, 2, 4 and 8 units of
# 4,000 bytes; 2 GPUs per node, every stage on both (each GPU holds, and receives, its own copy).
UNIT = 4000
_SIZES = (1, 2, 4, 8)


def _hand_profile():
    from oobleck_hpc.profiling.profile import (Fingerprint, LayerProfile, LinkCost,
                                               MachineProfile, ModelProfile)
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1000 * u, 1000 * u, 3000 * u, 100, 100)
                   for i, u in enumerate(_SIZES))
    link = LinkCost(0.01, 1e9)
    machine = MachineProfile("hand", 10**9, 2, link, link, link, link)
    fp = Fingerprint("hand", "x", 1, "float32", "hand", 2, "hand", source="analytic")
    return ModelProfile(fp, machine, layers)


def _hand_template(profile, node_layers: list[tuple[int, int]]):
    """One stage per node, on both of its GPUs (peak memory left 0: reconfigure never reads it)."""
    from oobleck_hpc.planning.plan import StageSpec, Template
    stages = tuple(StageSpec(a, b, i, (0, 1)) for i, (a, b) in enumerate(node_layers))
    t = Template(len(stages), 2, stages,
                 tuple(cost.stage_forward_ms(profile, a, b, 2) for a, b in node_layers),
                 tuple(cost.stage_backward_ms(profile, a, b, 2, 4) for a, b in node_layers),
                 tuple(cost.send_ms(profile, b - 1, False) for _, b in node_layers[:-1]),
                 (0,) * len(stages), microbatches=4)
    return replace(t, iteration_ms=cost.pipeline_iteration_ms(t, 4))


def test_survivability_moved_bytes_by_hand():
    """Pipelines a0-a2 (layers 0 | 1-2 | 3) and b0-b1 (0-1 | 2-3). Losing b0 leaves 4 nodes:
    two 2-node pipelines. b1 (held 2-3) keeps its place; a2 (held 3) becomes its first node
    and receives layers 0 and 1; a0 and a1 (held 0, and 1-2) form the other pipeline, a0
    receiving layer 1 and a1 layer 3. Bytes: (1 + 2) + 2 + 8 = 13 units per GPU, 2 GPUs per
    node. Losing a0 moves less: a1 receives layer 0, a2 layer 2, (1 + 4) x 2 units."""
    from oobleck_hpc.planning.cli import survivability
    profile = _hand_profile()
    templates = {2: _hand_template(profile, [(0, 2), (2, 4)]),
                 3: _hand_template(profile, [(0, 1), (1, 3), (3, 4)])}
    plan = build_plan(templates, [3, 2], ["a0", "a1", "a2", "b0", "b1"], 8, profile)
    assert [p.nodes for p in plan.pipelines] == [("a0", "a1", "a2"), ("b0", "b1")]
    rows = survivability(plan, templates, profile, 1, 1)
    assert rows[0]["moved_bytes"] == 0
    assert rows[1]["pattern"] == "1 of 2-node pipelines" and rows[1]["patterns"] == 2
    assert rows[1]["moved_bytes"] == 13 * 2 * UNIT
    assert sum(t.nbytes for t in transfer_plan(plan, reconfigure(plan, ["a0"], templates,
                                                                 profile, 1), profile)) \
        == (1 + 4) * 2 * UNIT


def test_a_replacement_node_takes_the_lost_nodes_place():
    """a0 (layer 0) is lost and spare s0 joins in the same round. The survivors a1 (layers 1-2)
    and a2 (layer 3) keep their positions and s0 takes a0's: only layer 0 moves, 1 unit to each
    of s0's 2 GPUs. (In the pipeline's old order, a1, a2, s0, every layer would move: 15 units
    per GPU.)"""
    profile = _hand_profile()
    templates = {3: _hand_template(profile, [(0, 1), (1, 3), (3, 4)])}
    plan = build_plan(templates, [3, 3], ["a0", "a1", "a2", "b0", "b1", "b2"], 8, profile)
    new = reconfigure(plan, ["a0"], templates, profile, 1, joined=["s0"])
    assert sorted(p.nodes for p in new.pipelines) == [("b0", "b1", "b2"), ("s0", "a1", "a2")]
    transfers = check_transfers(plan, new, profile)
    assert {(t.layer, new.ranks[t.dst_rank].node) for t in transfers} == {(0, "s0")}
    assert sum(t.nbytes for t in transfers) == 1 * 2 * UNIT
