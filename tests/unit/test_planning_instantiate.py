"""Instantiation is exact: on every small case (N <= 24) the polynomial algorithm finds the step
time of exhaustive enumeration over all multisets of templates and all batch splits."""

from __future__ import annotations

import math
import random

import pytest

from oobleck_hpc.errors import PlanningError
from oobleck_hpc.planning import cost
from oobleck_hpc.planning.instantiate import instantiate, split_microbatches
from oobleck_hpc.planning.templates import build_templates
from test_planning_templates import random_profile


def multisets(M: int, sizes: list[int], start: int = 0):
    if M == 0:
        yield []
        return
    for i in range(start, len(sizes)):
        if sizes[i] <= M:
            for rest in multisets(M - sizes[i], sizes, i):
                yield [sizes[i]] + rest


def best_split(times: list[tuple[float, float]], B: int) -> float:
    """min over integer splits (each >= 1, sum B) of max A + (m-1) beta: binary search on the
    answer among all tau values (independent of the greedy the planner uses)."""
    cands = sorted({a + (m - 1) * b for a, b in times for m in range(1, B + 1)})
    def ok(z):
        caps = [sum(1 for m in range(1, B + 1) if a + (m - 1) * b <= z) for a, b in times]
        return all(c >= 1 for c in caps) and sum(caps) >= B
    lo, hi = 0, len(cands) - 1
    if not ok(cands[hi]):
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(cands[mid]) else (mid + 1, hi)
    return cands[lo]


def exhaustive(templates, profile, M: int, B: int, f: int) -> float:
    best = math.inf
    sizes = sorted(templates)
    for ms in multisets(M, sizes):
        P = len(ms)
        if P < f + 1 or P > B:
            continue
        single = P == 1
        times = []
        for s in ms:
            t = templates[s]
            w = 0.0 if single else cost.template_sync_ms(t, profile)
            beta = max(a + b for a, b in zip(t.stage_forward_ms, t.stage_backward_ms))
            times.append((cost.pipeline_iteration_ms(t, 1) + w, beta))
        best = min(best, best_split(times, B))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_instantiation_equals_exhaustive_enumeration(seed):
    rng = random.Random(seed)
    G = rng.choice([1, 2])
    L = rng.randint(8, 26)
    profile = random_profile(rng, L, G, memory=rng.choice([10**9, 500_000]))
    templates = build_templates(profile, range(1, 25), rng.choice([2, 4, 8]))
    for _ in range(3):
        M = rng.randint(1, 24)
        B = rng.randint(1, 40)
        f = rng.randint(0, 3)
        want = exhaustive(templates, profile, M, B, f)
        nodes = [f"n{i}" for i in range(M)]
        if want == math.inf:
            with pytest.raises(PlanningError):
                instantiate(templates, nodes, B, f, profile)
            continue
        plan = instantiate(templates, nodes, B, f, profile)
        assert plan.predicted_iteration_ms == pytest.approx(want, rel=1e-9), (seed, M, B, f)
        assert plan.predicted_iteration_ms == cost.plan_iteration_ms(plan, profile)
        assert sorted(plan.nodes) == sorted(nodes) and len(plan.pipelines) >= f + 1
        assert sum(p.microbatches for p in plan.pipelines) == B
        assert all(p.microbatches >= 1 for p in plan.pipelines)


def test_split_is_balanced_and_exact():
    m = split_microbatches([10.0, 10.0, 30.0], [1.0, 2.0, 1.0], 40)
    assert sum(m) == 40 and min(m) >= 1
    worst = max(a + (x - 1) * b for a, b, x in zip([10.0, 10.0, 30.0], [1.0, 2.0, 1.0], m))
    assert worst == best_split([(10.0, 1.0), (10.0, 2.0), (30.0, 1.0)], 40)


def test_refuses_with_the_numbers():
    profile = random_profile(random.Random(2), 6, 1, memory=10**9)
    templates = build_templates(profile, range(1, 7), 4)
    with pytest.raises(PlanningError, match=r"at least f \+ 1 = 4 pipelines"):
        instantiate(templates, ["a", "b", "c"], 16, 3, profile)
    with pytest.raises(PlanningError):
        instantiate(templates, ["a", "b", "c"], 1, 1, profile)  # 1 microbatch, 2 pipelines


def test_same_inputs_same_plan():
    profile = random_profile(random.Random(4), 12, 2, memory=10**9)
    templates = build_templates(profile, range(1, 13), 4)
    nodes = [f"n{i}" for i in range(17)]
    a = instantiate(templates, nodes, 64, 2, profile)
    b = instantiate(build_templates(profile, range(1, 13), 4), list(nodes), 64, 2, profile)
    assert a.digest() == b.digest()
