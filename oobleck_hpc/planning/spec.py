"""Node specification (paper section 4.1.1): which template sizes a job needs.

n0 is the fewest nodes on which one replica of the model fits in memory. The job starts with at
least f + 1 pipelines (so no pipeline is larger than N - f * n0), but after k <= f losses it runs
on M = N - k nodes, and M can fall below (f + 1) * n0: then fewer, larger pipelines must cover
the survivors (reconfigure.py asks for min(f + 1, M // n0) of them, which is still at least
f + 1 - k, so the remaining f - k failures stay covered). Sizes up to N - f * n0 are not enough
for that (N = 6, n0 = 3, f = 1: the 5 survivors need one 5-node pipeline), so templates are built
for every size in [n0, N] (that has one: a template never has more nodes than the model has
layers, and every size's memory is checked).

Claim. If every size in [n0, min(2 n0 - 1, N)] has a template, then every node count M in
[n0, N] is a sum of q = floor(M / n0) template sizes, and q >= min(f + 1, q) is as many pipelines
as reconfiguration asks for; in particular every M in [N - f, N] (all >= n0, since
N >= (f + 1) n0) is covered with no idle node.

Proof. Let r = M - q n0, so 0 <= r < n0. Take q parts of n0 and spread r over them as evenly as
possible: each part is n0 + floor(r / q) or n0 + ceil(r / q). If q = 1 the part is M itself,
with n0 <= M <= min(2 n0 - 1, N); if q >= 2 each part is at most n0 + ceil((n0 - 1) / 2)
<= 2 n0 - 1 and less than M <= N. Every part lies in [n0, min(2 n0 - 1, N)]. QED. `decompose`
builds exactly this decomposition; the property test checks it over random (n0, M).

The premise can fail (a size in [n0, 2 n0 - 1] above the layer count, or one that does not fit
in memory) without the guarantee failing (another decomposition may exist), and the proof does
not bound the number of pipelines by the batch (each needs at least one of the B microbatches).
So the job is not judged by the premise: `plan_job` checks the guarantee exactly, for every
survivor count N - f .. N - 1, with the very call reconfiguration makes
(reconfigure.check_reconfigurable), and refuses the job before allocation where one fails.
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
    """Sizes templates are built for: every feasible size in [n0, N] (up to the layer count)."""


def decompose(M: int, n0: int) -> list[int]:
    """The docstring's decomposition of M >= n0 into M // n0 sizes in [n0, min(2 n0 - 1, M)]."""
    if M < n0:
        raise ValueError(f"M={M} is below n0={n0}: no pipeline fits")
    q, r = divmod(M, n0)
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
    return NodeSpec(n0, f, num_nodes, tuple(feasible))  # every feasible size in [n0, min(N, L)]
