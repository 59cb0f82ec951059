"""Node specification (paper section 4.1.1): which template sizes a job needs.

n0 is the fewest nodes on which one replica of the model fits in memory. With f simultaneous
failures to survive, the job keeps at least f + 1 pipelines, so no pipeline is ever larger than
N - f * n0; templates are built for every size in [n0, N - f * n0] (that has one: a template
never has more nodes than the model has layers, and every size's memory is checked).

Claim. If every size in [n0, min(2 n0 - 1, N - f n0)] has a template, then every node count M in
[(f + 1) n0, N] is a sum of at least f + 1 template sizes, so whatever nodes are lost (up to the
guarantee) the survivors can be covered with no idle node.

Proof. Let q = floor(M / n0) >= f + 1 and r = M - q n0, so 0 <= r < n0. Take q parts of n0 and
add r to them: one each to r of the parts when r <= q (parts n0 and n0 + 1), else spread r as
evenly as possible (each part gets floor(r/q) or ceil(r/q) <= ceil((n0 - 1) / q) <= n0 - 1).
Every part lies in [n0, 2 n0 - 1]. It remains to show no part exceeds N - f n0:
 - if q >= f + 2, then N >= M >= (f + 2) n0, so N - f n0 >= 2 n0 > any part;
 - if q = f + 1, put all of r on one part instead: the parts are n0 (f times) and n0 + r, and
   n0 + r = M - f n0 <= N - f n0; also n0 + r <= 2 n0 - 1.
In both cases every part is a size in [n0, min(2 n0 - 1, N - f n0)], and there are q >= f + 1
parts. QED. `decompose` builds exactly this decomposition; the property test checks it over
random (n0, N, f), and `node_specification` verifies the premise (refusing the job otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_hpc.errors import PlanningError
from oobleck_hpc.planning import cost
from oobleck_hpc.planning.templates import feasible_node_counts
from oobleck_hpc.profiling.profile import ModelProfile


@dataclass(frozen=True)
class NodeSpec:
    n0: int
    """Fewest nodes on which one replica fits."""
    f: int
    """Simultaneous node failures survived in place."""
    num_nodes: int
    """N: the job's nodes."""
    template_sizes: tuple[int, ...]
    """Sizes templates are built for: every feasible size in [n0, N - f * n0]."""


def template_size_range(n0: int, num_nodes: int, f: int) -> range:
    return range(n0, num_nodes - f * n0 + 1)


def decompose(M: int, n0: int, num_nodes: int, f: int) -> list[int]:
    """The docstring's decomposition of M into >= f + 1 sizes in [n0, min(2n0-1, N - f n0)]."""
    if not (f + 1) * n0 <= M <= num_nodes:
        raise ValueError(f"M={M} is outside [(f+1)*n0, N] = [{(f + 1) * n0}, {num_nodes}]")
    q, r = divmod(M, n0)
    if q == f + 1:
        return [n0] * f + [n0 + r]
    base, extra = divmod(r, q)
    return [n0 + base + (1 if i < extra else 0) for i in range(q)]


def node_specification(profile: ModelProfile, num_nodes: int, f: int,
                       microbatches: int = 1) -> NodeSpec:
    """n0 and the template sizes of a job of `num_nodes` nodes surviving `f` failures.

    Feasibility is memory only and does not depend on `microbatches` (cost.py bounds the
    microbatches in flight from the pipeline's suffix), so neither does the result; the argument
    is kept so callers state the batch the templates will be built for.
    """
    if f < 0:
        raise PlanningError(f"fault_tolerance.f = {f} must be >= 0")
    if num_nodes < 1:
        raise PlanningError(f"a job needs at least 1 node, got {num_nodes}")
    feasible = feasible_node_counts(profile, min(num_nodes, profile.num_layers))
    G = profile.machine.gpus_per_node
    mem = profile.machine.device_memory_bytes
    if not feasible:
        biggest = max(range(profile.num_layers),
                      key=lambda l: cost.stage_memory_bytes(profile, l, l + 1, G, 1))
        need = cost.stage_memory_bytes(profile, biggest, biggest + 1, G, 1)
        raise PlanningError(
            f"model {profile.fingerprint.model_name!r} fits on no number of nodes up to "
            f"{min(num_nodes, profile.num_layers)} ({G} GPUs of {mem / 1e9:.1f} GB each): e.g. "
            f"layer {biggest} ({profile.layers[biggest].name}) alone needs {need / 1e9:.1f} GB per "
            f"GPU even on {G} GPUs with one microbatch in flight. Fix: a smaller microbatch, "
            f"more nodes, or GPUs with more memory")
    n0 = feasible[0]
    if num_nodes < (f + 1) * n0:
        raise PlanningError(
            f"{num_nodes} nodes cannot hold f + 1 = {f + 1} replicas: one replica needs n0 = {n0} "
            f"nodes, so surviving f = {f} failures needs at least (f + 1) * n0 = {(f + 1) * n0} "
            f"nodes. Fix: allocate >= {(f + 1) * n0} nodes, or lower fault_tolerance.f to "
            f"{max(0, num_nodes // n0 - 1)}")
    sizes = tuple(n for n in template_size_range(n0, num_nodes, f) if n in set(feasible))
    needed = range(n0, min(2 * n0 - 1, num_nodes - f * n0) + 1)
    missing = [n for n in needed if n not in sizes]
    if missing:
        why = (f"the model has only {profile.num_layers} layers (a node holds at least one)"
               if missing[0] > profile.num_layers else "those sizes do not fit in memory")
        raise PlanningError(
            f"no pipeline template exists for {missing[0]} nodes ({why}), so some node counts "
            f"between {(f + 1) * n0} and {num_nodes} could not be covered without idle nodes "
            f"(n0 = {n0}, f = {f}). Fix: use {(f + 1) * n0} nodes, or a model with more layers")
    return NodeSpec(n0, f, num_nodes, sizes)
