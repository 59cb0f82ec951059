"""Where a rank stands when a new generation settles the step a failed vote left open: its value
in the reconcile exchange (recovery/rounds.py `reconcile`), from which a joining node also
rebuilds its members' base plan (recovery/join.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from oobleck_hpc.errors import RecoveryError


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
    def parse(cls, node: str, value: Any) -> Standing:
        """One rank's value from `node` in the reconcile exchange: RecoveryError (in-place
        recovery cannot trust that exchange: the checkpoint fallback) unless it is a standing,
        field for field (the tuples as JSON lists, or as they are within one process)."""
        groups = value.get("groups") if isinstance(value, dict) else None
        if not (isinstance(value, dict) and set(value) == {f.name for f in fields(cls)}
                and all(type(value[k]) is int for k in _INTS)
                and all(isinstance(value[k], str) for k in ("base", "prepared"))
                and isinstance(groups, (list, tuple))
                and all(isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g)
                        for g in groups)):
            raise RecoveryError(f"{node} sent a malformed standing in the reconcile exchange: "
                                f"{str(value)[:200]}; falling back to the last checkpoint")
        return cls(**{**value, "groups": tuple(tuple(g) for g in groups)})

    @classmethod
    def every(cls, values: dict[str, Any]) -> list[tuple[str, int, Standing]]:
        """(node, local rank, standing) of every rank in an exchange's values (node -> a list,
        one value per rank), each checked (`parse`)."""
        out = []
        for node, per_node in values.items():
            if not isinstance(per_node, list):
                raise RecoveryError(f"{node} sent no list of standings in the reconcile "
                                    f"exchange: {str(per_node)[:200]}")
            out += [(node, lr, cls.parse(node, v)) for lr, v in enumerate(per_node)]
        return out

    @classmethod
    def gathered(cls, values: dict[str, Any]) -> list[Standing]:
        """The members' standings from an exchange's values (node -> one per rank): joiners,
        which have nothing to say, are left out."""
        return [x for _, _, x in cls.every(values) if x.step >= 0]

    @classmethod
    def fresh(cls, values: dict[str, Any], nodes) -> frozenset[tuple[str, int]]:
        """(node, local rank) of the ranks that said JOINER on a node of `nodes` (the base
        plan's): restarted workers (control/agent.py), whose layers must come from replicas."""
        return frozenset((node, lr) for node, lr, x in cls.every(values)
                         if node in nodes and x.step < 0)


_INTS = ("step", "cursor", "base_gen", "template_nodes")


JOINER = Standing("", -1, -1, "", (), -1, 0)
