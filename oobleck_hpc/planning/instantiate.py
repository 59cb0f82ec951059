"""Instantiation and batch distribution (paper section 4.2), exact and polynomial.

Given templates (sizes s with template t_s), M live nodes, the global batch B (microbatches) and
f: choose how many pipelines of each template (all M nodes used, P >= f + 1 pipelines) and how
many microbatches each gets (integers >= 1 summing to B) to minimise the step time of cost.py:

    step = max_p  tau_p(m_p),    tau_s(m) = A_s + (m - 1) * beta_s,
    A_s = pipe_s(1) + w_s,  beta_s = max_i t_i of template s   (w_s = 0 when P = 1)

The reference enumerates every multiset of templates (as many as the partitions of M) and solves
an integer programme for each. Here, for a candidate step time Z, a pipeline of size s can take
at most cap_s(Z) = #{m in 1..B : tau_s(m) <= Z} microbatches (none if tau_s(1) > Z), and

    Z is achievable  <=>  some multiset with sum of sizes = M, f + 1 <= P <= B, has
                          sum of cap_s(Z) >= B   (each used size with cap >= 1)

(=>: the optimal split itself; <=: give every pipeline 1 microbatch, then fill up to the caps.)
The maximum of sum cap over multisets is an unbounded knapsack over node counts:

    best[m][c] = max_s  best[m - s][c - 1] + cap_s(Z)      c = pipelines (capped at f + 1 when
                                                           the bound P <= B cannot bind)

O(M * |sizes| * C) per Z. The optimum Z* is one of the finitely many values tau_s(m); binary
search over their sorted list finds the smallest achievable one: O(log(|sizes| B)) knapsacks.
Then the split: start with one microbatch each and give the next one to the pipeline whose
tau(m_p + 1) is smallest (greedy is optimal for a min-max of increasing functions); its maximum
is Z*. Plan time = that maximum.

A single pipeline (P = 1, only when f = 0) has no cross-pipeline reduction (w = 0); it is
compared separately.

Ties (determinism): the knapsack keeps the first maximum in ascending size order; pipelines are
listed by size, largest first, then by microbatches, and take the given nodes in order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from oobleck_hpc.errors import PlanningError
from oobleck_hpc.planning import cost
from oobleck_hpc.planning.plan import PipelineSpec, Plan, Template
from oobleck_hpc.profiling.profile import ModelProfile


def _costs(templates: Mapping[int, Template], profile: ModelProfile, sizes: list[int],
           single: bool) -> tuple[np.ndarray, np.ndarray]:
    A, beta = [], []
    for s in sizes:
        t = templates[s]
        A.append(cost.pipeline_iteration_ms(t, 1) + (0.0 if single else cost.template_sync_ms(t, profile)))
        beta.append(max(f + b for f, b in zip(t.stage_forward_ms, t.stage_backward_ms)))
    return np.array(A), np.array(beta)


def resplit(plan: Plan, profile: ModelProfile, slowdown: Mapping[str, float]) -> Plan:
    """The same pipelines, the global batch re-split (`split_microbatches`) with each pipeline's
    costs times the slowdown of its slowest node (recovery/straggler.py): a slow pipeline gets
    fewer microbatches. {} gives the split the plan would have without one."""
    from dataclasses import replace

    sizes = [p.template.num_nodes for p in plan.pipelines]
    A, beta = _costs({p.template.num_nodes: p.template for p in plan.pipelines}, profile, sizes,
                     len(sizes) == 1)
    s = [max(slowdown.get(n, 1.0) for n in p.nodes) for p in plan.pipelines]
    mbs = split_microbatches(list(A * s), list(beta * s), plan.global_microbatches)
    out = replace(plan, pipelines=tuple(replace(p, microbatches=m)
                                        for p, m in zip(plan.pipelines, mbs)))
    return replace(out, predicted_iteration_ms=cost.plan_iteration_ms(out, profile))


def split_microbatches(A: Sequence[float], beta: Sequence[float], total: int) -> list[int]:
    """Integers m_p >= 1 summing to `total` minimising max_p A_p + (m_p - 1) beta_p (greedy;
    ties to the lower index)."""
    P = len(A)
    if total < P:
        raise PlanningError(f"{total} microbatches cannot feed {P} pipelines (each needs >= 1)")
    m = [1] * P
    heap = [(A[p] + beta[p], p) for p in range(P)]
    heapq.heapify(heap)
    for _ in range(total - P):
        _, p = heapq.heappop(heap)
        m[p] += 1
        heapq.heappush(heap, (A[p] + m[p] * beta[p], p))
    return m


def _knapsack(sizes: np.ndarray, caps: np.ndarray, M: int, C: int, capped: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """best[m, c]: max total capacity with exactly m nodes and c pipelines (c = C means >= C
    when capped). Returns best, choice (size index), previous c."""
    NEG = -1
    best = np.full((M + 1, C + 1), NEG, dtype=np.int64)
    choice = np.full((M + 1, C + 1), -1, dtype=np.int64)
    prevc = np.full((M + 1, C + 1), -1, dtype=np.int64)
    best[0, 0] = 0
    usable = caps >= 1
    sz, cp = sizes[usable], caps[usable]
    ids = np.nonzero(usable)[0]
    if len(sz) == 0:
        return best, choice, prevc
    cols = np.arange(C + 1)
    for m in range(1, M + 1):
        ok = sz <= m
        if not ok.any():
            continue
        s, c_, i_ = sz[ok], cp[ok], ids[ok]
        prev = best[m - s]  # (n, C+1)
        val = np.where(prev >= 0, prev + c_[:, None], NEG)
        shifted = np.full_like(val, NEG)
        pc = np.broadcast_to(cols - 1, val.shape).copy()
        shifted[:, 1:] = val[:, :-1]
        if capped:
            keep = val[:, C] > shifted[:, C]
            shifted[:, C] = np.where(keep, val[:, C], shifted[:, C])
            pc[:, C] = np.where(keep, C, C - 1)
        j = shifted.argmax(axis=0)
        best[m] = shifted[j, cols]
        choice[m] = np.where(best[m] >= 0, i_[j], -1)
        prevc[m] = np.where(best[m] >= 0, pc[j, cols], -1)
    return best, choice, prevc


_CACHE: dict[tuple, tuple] = {}


def _best_multiset(templates: Mapping[int, Template], profile: ModelProfile, M: int, B: int,
                   min_pipes: int) -> tuple[float, tuple[int, ...]] | None:
    """(Z*, sizes of the pipelines) for P >= max(min_pipes, 2), or None. The answer depends on
    the node count only, so it is memoised per (templates, profile) object (reconfiguration and
    the survivability table ask for the same counts again and again)."""
    key = (id(templates), id(profile), M, B, min_pipes)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is templates and hit[1] is profile:
        return hit[2]
    out = _best_multiset_uncached(templates, profile, M, B, min_pipes)
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = (templates, profile, out)
    return out


def _best_multiset_uncached(templates: Mapping[int, Template], profile: ModelProfile, M: int,
                            B: int, min_pipes: int) -> tuple[float, tuple[int, ...]] | None:
    sizes = sorted(s for s in templates if s <= M)
    if not sizes:
        return None
    A, beta = _costs(templates, profile, sizes, single=False)
    sz = np.array(sizes)
    m = np.arange(B)
    table = A[:, None] + m[None, :] * beta[:, None]  # tau_s(m + 1), rows ascending
    cands = np.unique(table)
    lo_pipes = max(min_pipes, 2)
    max_pipes = M // sizes[0]
    if lo_pipes > min(max_pipes, B):
        return None
    capped = B >= max_pipes
    C = lo_pipes if capped else B

    def caps_at(Z: float) -> np.ndarray:
        return np.array([np.searchsorted(row, Z, side="right") for row in table], dtype=np.int64)

    def solve(Z: float):
        best, choice, prevc = _knapsack(sz, caps_at(Z), M, C, capped)
        cs = [C] if capped else list(range(lo_pipes, B + 1))
        for c in cs:
            if best[M, c] >= B:
                return best, choice, prevc, c
        return None

    if solve(float(cands[-1])) is None:
        return None
    lo, hi = 0, len(cands) - 1  # smallest index with a solution
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(float(cands[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    Z = float(cands[lo])
    _, choice, prevc, c = solve(Z)
    out: list[int] = []
    m_left = M
    while m_left > 0:
        i = int(choice[m_left, c])
        out.append(sizes[i])
        c = int(prevc[m_left, c])
        m_left -= sizes[i]
    return Z, tuple(out)


def build_plan(templates: Mapping[int, Template], pipeline_sizes: Sequence[int],
               nodes: Sequence[str], global_microbatches: int, profile: ModelProfile,
               generation: int = 0) -> Plan:
    """Pipelines of the given sizes on `nodes` (in order), the batch split optimally."""
    sizes = sorted(pipeline_sizes, reverse=True)
    single = len(sizes) == 1
    A, beta = _costs(templates, profile, sizes, single)
    mbs = split_microbatches(list(A), list(beta), global_microbatches)
    order = sorted(range(len(sizes)), key=lambda p: (-sizes[p], -mbs[p], p))
    pipes, at = [], 0
    for p in order:
        s = sizes[p]
        pipes.append(PipelineSpec(templates[s], tuple(nodes[at:at + s]), mbs[p]))
        at += s
    if at != len(nodes):
        raise PlanningError(f"pipelines of {sum(sizes)} nodes do not use the {len(nodes)} nodes")
    plan = Plan(tuple(pipes), global_microbatches, 0.0, generation)
    from dataclasses import replace

    return replace(plan, predicted_iteration_ms=cost.plan_iteration_ms(plan, profile))


def instantiate(templates: Mapping[int, Template], nodes: Sequence[str], global_microbatches: int,
                f: int, profile: ModelProfile, generation: int = 0) -> Plan:
    """The fastest plan on `nodes` with at least f + 1 pipelines (see the module docstring)."""
    M, B = len(nodes), global_microbatches
    if len(set(nodes)) != M:
        raise PlanningError("node names must be distinct")
    if not templates:
        raise PlanningError("no pipeline templates to instantiate")
    options: list[tuple[float, tuple[int, ...]]] = []
    if f == 0 and M in templates and B >= 1:
        options.append((cost.pipeline_iteration_ms(templates[M], B), (M,)))
    found = _best_multiset(templates, profile, M, B, f + 1)
    if found is not None:
        options.append(found)
    if not options:
        n0 = min(templates)
        raise PlanningError(
            f"no plan covers {M} nodes with at least f + 1 = {f + 1} pipelines and a batch of {B} "
            f"microbatches (template sizes {min(templates)}..{max(templates)}, n0 = {n0}). Fix: "
            f"use at least {(f + 1) * n0} nodes, lower fault_tolerance.f, or raise "
            f"train.global_microbatches to at least {f + 1}")
    options.sort(key=lambda o: (o[0], len(o[1])))
    return build_plan(templates, options[0][1], nodes, B, profile, generation)
