"""Who writes what: the one rank that writes each layer, and the rank that writes the training state.

Pure arithmetic on the plan (no torch): every rank computes the same map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oobleck_hpc.errors import CheckpointError

if TYPE_CHECKING:
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.profiling.profile import ModelProfile


def shard_owners(plan: Plan, profile: ModelProfile | None = None) -> dict[int, int]:
    """layer -> the one rank (among the layer's replicas) that writes it into a checkpoint.

    Deterministic (every rank computes the same map) and balanced: layers are taken from the
    largest to the smallest (bytes of parameters + optimizer state from `profile`, else equal
    weights) and each goes to the replica whose node has written the fewest bytes so far (a node's
    link to the shared filesystem is the bottleneck), then the rank with the fewest bytes, then the
    lowest rank.
    """
    n = plan.num_layers
    if profile is not None and profile.num_layers != n:
        raise CheckpointError(f"profile has {profile.num_layers} layers but the plan has {n}")
    weight = [profile.layers[i].state_bytes if profile is not None else 1 for i in range(n)]
    node_of = {r.rank: r.node for r in plan.ranks}
    node_bytes: dict[str, int] = {}
    rank_bytes: dict[int, int] = {}
    owners: dict[int, int] = {}
    for layer in sorted(range(n), key=lambda i: (-weight[i], i)):
        candidates = plan.layer_owners(layer)
        if not candidates:
            raise CheckpointError(f"layer {layer} has no replica in plan generation {plan.generation}")
        best = min(candidates, key=lambda r: (node_bytes.get(node_of[r], 0), rank_bytes.get(r, 0), r))
        owners[layer] = best
        node_bytes[node_of[best]] = node_bytes.get(node_of[best], 0) + weight[layer]
        rank_bytes[best] = rank_bytes.get(best, 0) + weight[layer]
    return dict(sorted(owners.items()))


def train_state_owner(plan: Plan) -> int:
    """The rank that writes the training state (the same on every rank: rank 0)."""
    del plan
    return 0


def plan_tag(plan: Plan) -> str:
    """A tag every rank of `plan` computes identically (see Checkpointer.save)."""
    return f"g{plan.generation}-{plan.digest()}"
