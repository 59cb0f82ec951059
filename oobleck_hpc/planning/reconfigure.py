"""Reconfiguration after node losses (paper section 5.1) and joins, and the state-transfer plan.

`reconfigure(plan, lost, templates, profile, f, joined)` returns the next generation's plan on the
surviving nodes plus the `joined` ones (spares, replacements). Candidates, each a list of node
groups (one per new pipeline):

- keep: every pipeline keeps its surviving nodes, in order, and takes the template of its new
  size (shrink). A pipeline left with fewer than n0 nodes (or a size with no template) is
  repaired: undersized pipelines are merged with each other (in plan order) while that helps;
  one still undersized borrows nodes, one at a time, from the currently largest pipeline that can
  spare one (ties: the earlier pipeline); if none can, it is merged into the smallest pipeline
  whose merged size has a template.
- fresh: instantiate() on the survivors (the fastest plan), its pipelines mapped onto surviving
  groups so that a surviving pipeline whose size reappears keeps its nodes and layout; the
  joined nodes fill the pipelines left over, after the survivors that no kept group took.
  With joins this is the only candidate (keep places no new node): growing back to N nodes
  gives the plan instantiate() gives on N nodes, as fast as the job's first plan.

Among the valid candidates (every size has a template, at least min(f + 1, M // n0) pipelines:
`min_pipelines`) the new plan minimises (predicted step time, bytes of state to move), then the
candidate order above. The batch is re-split for whichever wins.

What decides the outcome. The fresh candidate is the fastest plan with at least
min_pipelines(M) pipelines (instantiate.py is exact) and a valid keep candidate is one such plan,
so for k <= f losses both whether reconfiguration succeeds and the new plan's step time depend
only on M, the survivors' count (keep wins only ties, on bytes moved); the layouts and the bytes
moved depend on which pipelines lose how many nodes, and which nodes. `loss_patterns` enumerates
one loss set per pattern of per-pipeline loss counts, up to permuting pipelines of the same size:
the planner's survivability table and the property test use it, and the test checks it against
every loss set on small jobs.

The f-failure guarantee. With at least f + 1 pipelines, k <= f lost nodes leave a whole pipeline,
so every layer survives; and the fresh candidate is exact (instantiate.py), so reconfiguration
succeeds for k losses iff instantiate() succeeds on N - k nodes with min_pipelines(N - k) - 1
failures to survive. `check_reconfigurable` makes exactly those calls for k = 1..f when the job is
planned (a failure there refuses the job before allocation, exit 2).

Beyond the guarantee -- some layer has no surviving replica, or fewer than n0 nodes remain --
GuaranteeExceeded is raised: the job falls back to its last checkpoint.

Node order. Which node of a new pipeline runs which of its template's positions is free: every
position of a template costs the same wherever it runs. Every candidate's groups are ordered by
`_order_nodes` to keep the most layer state where it is: a pipeline that lost its node at
position 0 takes its replacement node there, and its other nodes keep their layers (in their
old order the survivors would all shift by one position and every layer would move).

`transfer_plan(old, new, profile)`: for every (layer, destination rank) of the new plan whose GPU
did not hold that layer in the old plan (a joined node's GPUs held none), one Transfer from a
surviving GPU that held it. Both
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
    alive_layers: set[int] = set()
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


def plan_from_groups(groups: list[list[str]], templates: Mapping[int, Template], B: int,
                     profile: ModelProfile, generation: int) -> Plan | None:
    """The plan whose pipelines are `groups` (node lists), each on the template of its size,
    the batch split over them; None if the batch cannot feed them. Also how a joining node
    rebuilds the members' plan from its groups (recovery/driver.py, join)."""
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


def _fresh_groups(plan: Plan, fresh: Plan, lost: set[str], joined: Sequence[str] = ()
                  ) -> list[list[str]]:
    """Map the fresh plan's pipeline sizes onto surviving groups to keep layouts; the joined
    nodes come last."""
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
    rest = [n for i, g in enumerate(old) if not used[i] for n in g] + list(joined)
    out = []
    for p, g in zip(fresh.pipelines, groups):
        if g is None:
            s = p.template.num_nodes
            g, rest = rest[:s], rest[s:]
        out.append(g)
    return out


def min_pipelines(num_nodes: int, n0: int, f: int) -> int:
    """Pipelines a plan on `num_nodes` surviving nodes must have: f + 1, or as many as fit."""
    return max(1, min(f + 1, num_nodes // n0))


def check_reconfigurable(templates: Mapping[int, Template], profile: ModelProfile,
                         num_nodes: int, global_microbatches: int, f: int) -> None:
    """Refuse (PlanningError) a job of `num_nodes` nodes whose plan would not survive some loss of
    k <= f nodes: for each k, spec.py's proof where its premise holds (every size in
    [n0, 2 n0 - 1] has a template and the batch feeds M // n0 pipelines), else the exact call
    reconfigure() makes as its fresh candidate (module docstring, "The f-failure guarantee")."""
    n0, B = min(templates), global_microbatches
    for k in range(1, f + 1):
        M = num_nodes - k
        need = min_pipelines(M, n0, f)
        if M // n0 <= B and all(s in templates for s in range(n0, min(2 * n0 - 1, M) + 1)):
            continue  # spec.py's proof: M // n0 >= need pipelines of sizes in [n0, 2 n0 - 1]
        try:
            instantiate(templates, [f"survivor{i}" for i in range(M)], B, need - 1, profile)
        except PlanningError:
            pass
        else:
            continue
        sizes = sorted(templates)
        absent = [s for s in range(n0, min(2 * n0 - 1, M) + 1) if s not in templates]
        raise PlanningError(
            f"the plan on {num_nodes} nodes would not survive {k} lost node(s) although "
            f"fault_tolerance.f = {f}: no plan covers the {M} survivors with at least {need} "
            f"pipelines of the template sizes {_ranges(sizes)} (n0 = {n0}"
            + (f"; no template for {_ranges(absent)} nodes: more nodes than the "
               f"{profile.num_layers} layers, or too little memory" if absent else "")
            + f") fed by train.global_microbatches = {B} (one microbatch at least per "
            f"pipeline). Fix: use a node count whose survivors are covered, or lower "
            f"fault_tolerance.f to {k - 1}"
            + (f", or raise train.global_microbatches to at least {M // n0}" if M // n0 > B else ""))


def _ranges(values: Sequence[int]) -> str:
    """'3..5, 8' for [3, 4, 5, 8]."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)


def loss_patterns(plan: Plan, k: int) -> list[tuple[str, tuple[str, ...]]]:
    """One loss set of `k` nodes per pattern of per-pipeline loss counts, up to permuting
    pipelines of the same size (module docstring): (description, lost nodes). The counts given
    to the pipelines of one size go in plan order, largest first; each pipeline loses its first
    nodes."""
    classes: dict[int, list[int]] = {}  # pipeline size -> pipeline indices, plan order
    for i, p in enumerate(plan.pipelines):
        classes.setdefault(len(p.nodes), []).append(i)
    order = sorted(classes, reverse=True)
    out: list[tuple[str, tuple[str, ...]]] = []

    def per_class(c: int, left: int, acc: list[tuple[int, tuple[int, ...]]]) -> None:
        if c == len(order):
            if left == 0:
                lost: list[str] = []
                words: list[str] = []
                for size, parts in acc:
                    for i, n in zip(classes[size], parts):
                        lost.extend(plan.pipelines[i].nodes[:n])
                    words.append(f"{'+'.join(map(str, parts))} of {size}-node pipelines")
                out.append((", ".join(words) if words else "none", tuple(lost)))
            return
        size = order[c]
        for parts in _partitions(left, size, len(classes[size])):
            per_class(c + 1, left - sum(parts), acc + ([(size, parts)] if parts else []))

    per_class(0, k, [])
    return out


def _partitions(most: int, largest: int, count: int) -> list[tuple[int, ...]]:
    """Non-increasing tuples of at most `count` parts in 1..`largest` summing to at most `most`."""
    out: list[tuple[int, ...]] = []
    if count > 0:
        for first in range(min(most, largest), 0, -1):
            out.extend((first,) + rest for rest in _partitions(most - first, first, count - 1))
    return out + [()]


def reconfigure(plan: Plan, lost: Collection[str], templates: Mapping[int, Template],
                profile: ModelProfile, f: int, joined: Sequence[str] = ()) -> Plan:
    """The next generation's plan after losing `lost` and adding `joined` (module docstring)."""
    return reconfigure_moved(plan, lost, templates, profile, f, joined)[0]


def reconfigure_moved(plan: Plan, lost: Collection[str], templates: Mapping[int, Template],
                      profile: ModelProfile, f: int, joined: Sequence[str] = ()
                      ) -> tuple[Plan, int]:
    """reconfigure(), and the bytes its transfer plan moves (`moved_bytes`, which it computes
    anyway to choose among the candidates)."""
    lost_set = set(lost)
    unknown = sorted(lost_set - set(plan.nodes))
    if unknown:
        raise PlanningError(f"lost nodes {unknown} are not part of the plan (nodes: "
                            f"{', '.join(plan.nodes[:8])}{'...' if len(plan.nodes) > 8 else ''})")
    again = sorted(set(joined) & set(plan.nodes))
    if again or len(set(joined)) != len(joined):
        raise PlanningError(f"joined nodes {list(joined)} must be new to the plan and distinct "
                            f"(already in it: {again})")
    if not templates:
        raise PlanningError("no templates to reconfigure with")
    n0 = min(templates)
    survivors = _check_guarantee(plan, lost_set, n0)
    B, gen = plan.global_microbatches, plan.generation + 1
    need = min_pipelines(len(survivors) + len(joined), n0, f)
    sizes = set(templates)
    candidates: list[Plan] = []
    held = _held_by_node(plan)
    size = [l.state_bytes for l in profile.layers]
    whole = {p.nodes: p.template for p in plan.pipelines}

    def ordered(groups: list[list[str]]) -> list[list[str]]:
        # a pipeline kept whole on its own template keeps everything already
        return [g if whole.get(tuple(g)) == templates[len(g)]
                else _order_nodes(g, templates[len(g)], held, size) for g in groups]

    groups = None if joined else _keep_groups(plan, lost_set, sizes, n0)
    if groups is not None and len(groups) >= need:
        groups = ordered(groups)
        p = plan_from_groups(groups, templates, B, profile, gen)
        if p is not None:
            candidates.append(p)
    try:
        fresh = instantiate(templates, survivors + list(joined), B, need - 1, profile, gen)
    except PlanningError:
        fresh = None
    if fresh is not None:
        groups = ordered(_fresh_groups(plan, fresh, lost_set, joined))
        p = plan_from_groups(groups, templates, B, profile, gen)
        if p is not None:
            candidates.append(p)
    if not candidates:
        raise GuaranteeExceeded(
            f"no plan covers the {len(survivors) + len(joined)} nodes with templates of sizes "
            f"{min(templates)}..{max(templates)}: falling back to the last checkpoint")
    scored = [(round(c.predicted_iteration_ms, 9), moved_bytes(plan, c, profile), i)
              for i, c in enumerate(candidates)]
    _, moved, best = min(scored)
    return candidates[best], moved


def _held_by_node(plan: Plan) -> dict[str, list[tuple[int, int, int]]]:
    """Node -> (local GPU, first layer, end layer) of every GPU of that node in `plan`."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for (node, g), (a, b) in _holdings(plan).items():
        out.setdefault(node, []).append((g, a, b))
    return out


def _order_nodes(group: Sequence[str], template: Template,
                 held: Mapping[str, Sequence[tuple[int, int, int]]],
                 size: Sequence[int]) -> list[str]:
    """The group's nodes in the order (node i runs the template's position i) that leaves the
    most layer state in place (module docstring, "Node order").

    kept(node, position) = state bytes of the layers a GPU of the node already holds and keeps
    at that position. Greedy: the (position, node) pairs by kept bytes, largest first (ties:
    position, then the node's place in the group), each taken while both are free; positions
    left over get the remaining nodes in group order. The group's own order is kept unless the
    greedy one keeps strictly more bytes."""
    wants: dict[tuple[int, int], list[int]] = {}  # (GPU, layer) -> positions that hold it
    for st in template.stages:
        for g in st.gpus:
            for l in st.layers:
                wants.setdefault((g, l), []).append(st.node)
    kept: dict[tuple[int, int], int] = {}  # (position, index in group) -> bytes kept
    for i, node in enumerate(group):
        for g, a, b in held.get(node, ()):
            for l in range(a, b):
                for pos in wants.get((g, l), ()):
                    kept[(pos, i)] = kept.get((pos, i), 0) + size[l]
    slots: list[int | None] = [None] * len(group)
    taken: set[int] = set()
    for (pos, i), _ in sorted(kept.items(), key=lambda kv: (-kv[1], kv[0])):
        if slots[pos] is None and i not in taken:
            slots[pos] = i
            taken.add(i)
    rest = iter(i for i in range(len(group)) if i not in taken)
    order = [i if i is not None else next(rest) for i in slots]
    greedy = sum(kept.get((pos, i), 0) for pos, i in enumerate(order))
    as_is = sum(kept.get((pos, pos), 0) for pos in range(len(group)))
    return [group[i] for i in order] if greedy > as_is else list(group)


def _holdings(plan: Plan) -> dict[tuple[str, int], tuple[int, int]]:
    out = {}
    for p in plan.pipelines:
        for s in p.template.stages:
            for g in s.gpus:
                out[(p.nodes[s.node], g)] = (s.layer_start, s.layer_end)
    return out


def transfer_plan(old: Plan, new: Plan, profile: ModelProfile,
                  fresh: frozenset[tuple[str, int]] = frozenset()) -> tuple[Transfer, ...]:
    """What to copy so that every rank of `new` holds its layers (module docstring). `fresh`:
    (node, GPU) of `old` whose state is gone although the node stays (a restarted worker)."""
    before = {k: v for k, v in _holdings(old).items() if k not in fresh}
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

