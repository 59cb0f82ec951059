"""Templates are exact: on every small instance (L <= 10, n <= 4, G in 1..4, random profiles)
the template equals brute-force enumeration of all partitions and GPU assignments, under the
cost model of planning/cost.py; and they are deterministic (in a fresh interpreter too:
tests/test_planning_fresh_process.py)."""

from __future__ import annotations

import functools
import math
import random

import pytest

from oobleck_hpc.planning import cost
from oobleck_hpc.planning.templates import build_templates, feasible_node_counts
from oobleck_hpc.profiling.profile import (Fingerprint, LayerProfile, LinkCost, MachineProfile,
                                           ModelProfile)


def random_profile(rng: random.Random, L: int, G: int, memory: int | None = None) -> ModelProfile:
    layers = []
    for i in range(L):
        p = rng.randint(1, 50) * 1000
        layers.append(LayerProfile(f"l{i}", rng.uniform(0.5, 5), rng.uniform(1, 10), p, p, 2 * p,
                                   rng.randint(1, 40) * 1000, rng.randint(0, 30) * 1000))
    memory = memory or rng.choice([10**9, 600_000, 400_000, 250_000])
    lat = rng.choice([0.0, 0.01, 0.2])
    intra, inter = LinkCost(lat, rng.uniform(1e7, 1e8)), LinkCost(2 * lat, rng.uniform(1e6, 2e7))
    machine = MachineProfile("test", memory, G, intra, inter, intra, inter)
    fp = Fingerprint("random", "x", 1, "float32", "test", G, "test", source="analytic")
    return ModelProfile(fp, machine, tuple(layers))


def _node_splits(a: int, r: int, G: int) -> list[list[tuple[int, int, int]]]:
    """Every split of layers [a, r) into stages (start, end, gpus) using exactly G GPUs."""
    out: list[list[tuple[int, int, int]]] = []

    def rec(x: int, u: int, acc: list) -> None:
        if x == r:
            if u == 0:
                out.append(list(acc))
            return
        for b in range(x + 1, r + 1):
            for k in range(1, u + 1):
                acc.append((x, b, k))
                rec(b, u - k, acc)
                acc.pop()

    rec(a, G, [])
    return out


def all_pipelines(L: int, n: int, G: int):
    """Every template of n nodes: contiguous layer blocks per node, each split into stages."""
    def rec(a: int, q: int):
        if q == 0:
            if a == L:
                yield []
            return
        for r in range(a + 1, L + 1):
            for split in _node_splits(a, r, G):
                for rest in rec(r, q - 1):
                    yield [split] + rest
    yield from rec(0, n)


def brute_force(profile: ModelProfile, n: int, m: int) -> float:
    """The least 1F1B time over all n-node pipelines that fit in memory (inf if none)."""
    L = profile.num_layers
    fwd = functools.cache(lambda a, b, k: cost.stage_forward_ms(profile, a, b, k)
                          + cost.stage_backward_ms(profile, a, b, k, m))
    fits = functools.cache(lambda a, b, k, i: cost.stage_fits(profile, a, b, k, i))
    best = math.inf
    for nodes in all_pipelines(L, n, profile.machine.gpus_per_node):
        stages = [(a, b, k, ni) for ni, split in enumerate(nodes) for (a, b, k) in split]
        times, comm, ok = [], 0.0, True
        gpus_after = sum(s[2] for s in stages)
        for i, (a, b, k, ni) in enumerate(stages):
            gpus_after -= k
            if not fits(a, b, k, cost.inflight_bound(gpus_after, L - b)):
                ok = False
                break
            times.append(fwd(a, b, k))
            if i + 1 < len(stages):
                comm += cost.send_ms(profile, b - 1, same_node=stages[i + 1][3] == ni)
        if ok:
            best = min(best, sum(times) + 2 * comm + (m - 1) * max(times))
    return best


def _instances(count: int, seed0: int):
    for seed in range(seed0, seed0 + count):
        rng = random.Random(seed)
        G = rng.choice([1, 2, 3, 4])
        L = rng.randint(2, {1: 10, 2: 10, 3: 9, 4: 8}[G])
        yield seed, rng, G, L, rng.choice([1, 2, 3, 5, 8, 16])


@pytest.mark.parametrize("block", range(8))
def test_templates_equal_brute_force(block):
    checked = 0
    for seed, rng, G, L, m in _instances(40, 1000 * block):
        profile = random_profile(rng, L, G)
        sizes = list(range(1, min(4, L) + 1))
        templates = build_templates(profile, sizes, m)
        for n in sizes:
            want = brute_force(profile, n, m)
            if n not in templates:
                assert want == math.inf, (seed, n)
                continue
            t = templates[n]
            got = cost.pipeline_iteration_ms(t, m)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (seed, G, L, m, n)
            assert t.iteration_ms == got
            # the template is a valid pipeline of n nodes using every GPU
            assert t.stages[0].layer_start == 0 and t.stages[-1].layer_end == L
            assert all(x.layer_end == y.layer_start for x, y in zip(t.stages, t.stages[1:]))
            used = sorted((s.node, g) for s in t.stages for g in s.gpus)
            assert used == [(i, g) for i in range(n) for g in range(G)]
            assert max(t.peak_memory_bytes) <= profile.machine.device_memory_bytes
            checked += 1
    assert checked > 50


def test_largest_instances_equal_brute_force():
    """L = 10 on 4 nodes of 4 GPUs (about 93,000 pipelines)."""
    rng = random.Random(7)
    profile = random_profile(rng, 10, 4, memory=10**9)
    templates = build_templates(profile, [1, 2, 3, 4], 6)
    for n in (1, 2, 3, 4):
        assert cost.pipeline_iteration_ms(templates[n], 6) == pytest.approx(
            brute_force(profile, n, 6), rel=1e-9)


def test_nonexistent_sizes_are_absent():
    rng = random.Random(3)
    profile = random_profile(rng, 5, 2, memory=10**9)
    templates = build_templates(profile, range(1, 9), 4)
    assert sorted(templates) == [1, 2, 3, 4, 5]  # a node holds at least one layer
    tight = random_profile(random.Random(3), 5, 1, memory=1)
    assert build_templates(tight, range(1, 6), 4) == {}
    assert feasible_node_counts(tight, 5) == []
