"""Reconfiguration after node losses (paper section 5.1) and the state-transfer plan.

`reconfigure(plan, lost, templates, profile, f)` returns the next generation's plan on the
surviving nodes. Candidates, each a list of node groups (one per new pipeline):

- keep: every pipeline keeps its surviving nodes, in order, and takes the template of its new
  size (shrink). A pipeline left with fewer than n0 nodes (or a size with no template) is
  repaired: undersized pipelines are merged with each other (in plan order) while that helps;
  one still undersized borrows nodes, one at a time, from the currently largest pipeline that can
  spare one (ties: the earlier pipeline); if none can, it is merged into the smallest pipeline
  whose merged size has a template.
- fresh: instantiate() on the survivors (the fastest plan), its pipelines mapped onto surviving
  groups so that a surviving pipeline whose size reappears keeps its nodes and layout.

Among the valid candidates (every size has a template, at least min(f + 1, M // n0) pipelines)
the new plan minimises (predicted step time, bytes of state to move), then the candidate order
above. The batch is re-split for whichever wins.

Beyond the guarantee -- some layer has no surviving replica, or fewer than n0 nodes remain --
GuaranteeExceeded is raised: the job falls back to its last checkpoint.

`transfer_plan(old, new, profile)`: for every (layer, destination rank) of the new plan whose GPU
did not hold that layer in the old plan, one Transfer from a surviving GPU that held it. Both
ranks are in the NEW plan's rank space (every source is a survivor, so it has a new rank). Bytes
are the layer's parameters plus optimizer state. Sources are chosen greedily to balance bytes
sent per node: transfers are taken largest first (then by layer, destination), each from the
candidate on the destination's own node if there is one (a local copy), else from the candidate
node that has sent the fewest bytes so far (ties: lowest rank).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from oobleck_hpc.errors import GuaranteeExceeded, PlanningError
from oobleck_hpc.planning.instantiate import build_plan, instantiate
from oobleck_hpc.planning.plan import Plan, Template
from oobleck_hpc.profiling.profile import ModelProfile


@dataclass(frozen=True)
class Transfer:
    layer: int
    src_rank: int
    dst_rank: int
    nbytes: int


def _check_guarantee(plan: Plan, lost: set[str], n0: int) -> list[str]:
    survivors = [n for n in plan.nodes if n not in lost]
    if len(survivors) < n0:
        raise GuaranteeExceeded(
            f"{len(survivors)} nodes survive ({len(lost)} lost: {', '.join(sorted(lost))}), fewer "
            f"than n0 = {n0} needed for one replica: falling back to the last checkpoint")
    alive_layers = set()
    for p in plan.pipelines:
        for s in p.template.stages:
            if p.nodes[s.node] not in lost:
                alive_layers.update(s.layers)
    missing = [l for l in range(plan.num_layers) if l not in alive_layers]
    if missing:
        raise GuaranteeExceeded(
            f"layer {missing[0]} (and {len(missing) - 1} more) has no surviving replica after "
            f"losing {', '.join(sorted(lost))}: falling back to the last checkpoint")
    return survivors


def _keep_groups(plan: Plan, lost: set[str], sizes: set[int], n0: int) -> list[list[str]] | None:
    groups = [[n for n in p.nodes if n not in lost] for p in plan.pipelines]
    groups = [g for g in groups if g]
    ok = lambda g: len(g) in sizes  # noqa: E731
    small = [g for g in groups if len(g) < n0]
    big = [g for g in groups if len(g) >= n0]
    # merge undersized pipelines with each other, in plan order, while that helps
    merged: list[list[str]] = []
    for g in small:
        if merged and len(merged[-1]) < n0:
            merged[-1] = merged[-1] + g
        else:
            merged.append(list(g))
    groups = big + merged
    for g in groups:
        while len(g) < n0:
            donors = [d for d in groups if d is not g and len(d) - 1 >= n0 and (len(d) - 1) in sizes]
            if not donors:
                break
            donor = max(donors, key=lambda d: (len(d), -groups.index(d)))
            g.append(donor.pop())
    if any(len(g) < n0 for g in groups):
        for g in [g for g in groups if len(g) < n0]:
            hosts = [h for h in groups if h is not g and (len(h) + len(g)) in sizes]
            if not hosts:
                return None
            host = min(hosts, key=lambda h: (len(h), groups.index(h)))
            host.extend(g)
            groups.remove(g)
    if not all(ok(g) for g in groups):
        return None
    return groups


def _plan_from_groups(groups: list[list[str]], templates: Mapping[int, Template], B: int,
                      profile: ModelProfile, generation: int) -> Plan | None:
    if B < len(groups):
        return None
    nodes = [n for g in sorted(groups, key=len, reverse=True) for n in g]
    # build_plan orders pipelines by size (stable): groups of equal size keep their order
    ordered = sorted(groups, key=len, reverse=True)
    plan = build_plan(templates, [len(g) for g in ordered], nodes, B, profile, generation)
    # build_plan sorts by (size, microbatches); reattach each pipeline to its own group
    by_size: dict[int, list[list[str]]] = {}
    for g in ordered:
        by_size.setdefault(len(g), []).append(g)
    pipes = []
    for p in plan.pipelines:
        g = by_size[p.template.num_nodes].pop(0)
        pipes.append(replace(p, nodes=tuple(g)))
    return replace(plan, pipelines=tuple(pipes))


def _fresh_groups(plan: Plan, fresh: Plan, lost: set[str]) -> list[list[str]]:
    """Map the fresh plan's pipeline sizes onto surviving groups to keep layouts."""
    old = [[n for n in p.nodes if n not in lost] for p in plan.pipelines]
    old_t = [p.template for p in plan.pipelines]
    used = [False] * len(old)
    groups: list[list[str] | None] = []
    for p in fresh.pipelines:
        s = p.template.num_nodes
        hit = next((i for i, g in enumerate(old) if not used[i] and len(g) == s
                    and len(plan.pipelines[i].nodes) == s and old_t[i] == p.template), None)
        if hit is None:
            hit = next((i for i, g in enumerate(old) if not used[i] and len(g) == s), None)
        if hit is not None:
            used[hit] = True
            groups.append(list(old[hit]))
        else:
            groups.append(None)
    rest = [n for i, g in enumerate(old) if not used[i] for n in g]
    out = []
    for p, g in zip(fresh.pipelines, groups):
        if g is None:
            s = p.template.num_nodes
            g, rest = rest[:s], rest[s:]
        out.append(g)
    return out


def reconfigure(plan: Plan, lost: Collection[str], templates: Mapping[int, Template],
                profile: ModelProfile, f: int) -> Plan:
    """The next generation's plan after losing `lost` (see the module docstring)."""
    lost_set = set(lost)
    unknown = sorted(lost_set - set(plan.nodes))
    if unknown:
        raise PlanningError(f"lost nodes {unknown} are not part of the plan (nodes: "
                            f"{', '.join(plan.nodes[:8])}{'...' if len(plan.nodes) > 8 else ''})")
    if not templates:
        raise PlanningError("no templates to reconfigure with")
    n0 = min(templates)
    survivors = _check_guarantee(plan, lost_set, n0)
    B, gen = plan.global_microbatches, plan.generation + 1
    need = max(1, min(f + 1, len(survivors) // n0))
    sizes = set(templates)
    candidates: list[Plan] = []
    groups = _keep_groups(plan, lost_set, sizes, n0)
    if groups is not None and len(groups) >= need:
        p = _plan_from_groups(groups, templates, B, profile, gen)
        if p is not None:
            candidates.append(p)
    try:
        fresh = instantiate(templates, survivors, B, need - 1, profile, gen)
    except PlanningError:
        fresh = None
    if fresh is not None:
        p = _plan_from_groups(_fresh_groups(plan, fresh, lost_set), templates, B, profile, gen)
        if p is not None:
            candidates.append(p)
    if not candidates:
        raise GuaranteeExceeded(
            f"no plan covers the {len(survivors)} surviving nodes with templates of sizes "
            f"{min(templates)}..{max(templates)}: falling back to the last checkpoint")
    scored = [(round(c.predicted_iteration_ms, 9), moved_bytes(plan, c, profile), i)
              for i, c in enumerate(candidates)]
    return candidates[min(scored)[2]]


def _holdings(plan: Plan) -> dict[tuple[str, int], tuple[int, int]]:
    out = {}
    for p in plan.pipelines:
        for s in p.template.stages:
            for g in s.gpus:
                out[(p.nodes[s.node], g)] = (s.layer_start, s.layer_end)
    return out


def transfer_plan(old: Plan, new: Plan, profile: ModelProfile) -> tuple[Transfer, ...]:
    """What to copy so that every rank of `new` holds its layers (module docstring)."""
    before = _holdings(old)
    G = new.gpus_per_node
    holders: dict[int, list[tuple[str, int]]] = {}  # layer -> surviving GPUs, new rank order
    for node in new.nodes:
        for g in range(G):
            held = before.get((node, g))
            if held is not None:
                for l in range(*held):
                    holders.setdefault(l, []).append((node, g))
    node_index = {n: i for i, n in enumerate(new.nodes)}
    needs = []
    for r in new.ranks:
        had = before.get((r.node, r.local_gpu))
        for l in range(r.layer_start, r.layer_end):
            if had is not None and had[0] <= l < had[1]:
                continue
            needs.append((l, r.rank, r.node))
    size = {l: profile.layers[l].param_bytes + profile.layers[l].optimizer_bytes
            for l in range(profile.num_layers)}
    needs.sort(key=lambda x: (-size[x[0]], x[0], x[1]))
    sent: dict[str, int] = {}
    out = []
    for l, dst, dst_node in needs:
        cands = holders.get(l)
        if not cands:
            raise GuaranteeExceeded(f"layer {l} has no surviving replica to copy from")
        local = [c for c in cands if c[0] == dst_node]
        if local:
            node, g = local[0]
        else:
            node, g = min(cands, key=lambda c: (sent.get(c[0], 0), node_index[c[0]] * G + c[1]))
            sent[node] = sent.get(node, 0) + size[l]
        out.append(Transfer(l, node_index[node] * G + g, dst, size[l]))
    out.sort(key=lambda t: (t.dst_rank, t.layer))
    return tuple(out)


def moved_bytes(old: Plan, new: Plan, profile: ModelProfile) -> int:
    """Bytes crossing between GPUs in the transfer plan (local copies included)."""
    return sum(t.nbytes for t in transfer_plan(old, new, profile))


def survivors_of(plan: Plan, lost: Sequence[str]) -> list[str]:
    return [n for n in plan.nodes if n not in set(lost)]
