"""Where a rank stands when a new generation settles the step a failed vote left open: its value
in the reconcile exchange (recovery/rounds.py `reconcile`), from which a joining node also
rebuilds its members' base plan (recovery/join.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Standing:
    """Where one rank stands, as it says in the reconcile exchange of a new generation
    (`reconcile`; sent as a JSON object)."""

    base: str
    """The digest of its base plan (the plan of its last committed step)."""
    step: int
    """Steps it committed; -1 for a node joining the job (`JOINER`: it has none)."""
    cursor: int
    prepared: str
    """The digest of the plan of a step it holds prepared (its vote did not complete), or ""."""
    groups: tuple[tuple[str, ...], ...]
    """Its base plan's pipelines (their nodes), from which a joiner rebuilds that plan."""
    base_gen: int
    template_nodes: int
    """The node count its templates were built for (a start that lost nodes planned afresh on
    fewer): a joiner builds the same ones to rebuild the base plan."""

    @classmethod
    def gathered(cls, values: dict[str, list[Any]]) -> list[Standing]:
        """The members' standings from an exchange's values (node -> one per rank): joiners,
        which have nothing to say, are left out."""
        every = [cls(**{**v, "groups": tuple(tuple(g) for g in v["groups"])})
                 for per_node in values.values() for v in per_node]
        return [x for x in every if x.step >= 0]

    @staticmethod
    def fresh(values: dict[str, list[Any]], nodes) -> frozenset[tuple[str, int]]:
        """(node, local rank) of the ranks that said JOINER on a node of `nodes` (the base
        plan's): restarted workers (control/agent.py), whose layers must come from replicas."""
        return frozenset((node, lr) for node, per_node in values.items() if node in nodes
                         for lr, v in enumerate(per_node) if v["step"] < 0)


JOINER = Standing("", -1, -1, "", (), -1, 0)
