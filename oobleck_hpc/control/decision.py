"""What the membership protocol (membership.py) agrees on and how it stops a node: a decided
generation (`Decision`), the quorum rule, and the exceptions the workers see (`Fenced`,
`Superseded`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from oobleck_hpc.errors import EXIT_REQUEUE, EXIT_UNRECOVERABLE, OobleckError

Quorum = Literal["majority", "none"]
LeaveKind = Literal["finished", "early", "abort", "drained"]


class Fenced(OobleckError):
    """This node must stop taking part in the job; its workers must stop. `exit_code` says how
    the node ends (oobleck_hpc/errors.py): 3 when its peers excluded it (they go on without it),
    75 when it cannot prove that it belongs to the majority (no quorum, an agreement timeout, a
    mutual exclusion): then it falls back to the last checkpoint and the job is requeued, and
    2 when a peer stopped the job for bad input."""

    def __init__(self, message: str, exit_code: int = EXIT_UNRECOVERABLE):
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def requeue(self) -> bool:
        """Fall back to the last checkpoint and requeue (rather than leave the job for good)."""
        return self.exit_code == EXIT_REQUEUE


class Superseded(OobleckError):
    """An exchange was cut short by a new membership round; redo it in the next generation."""


def has_quorum(prev: Sequence[str], view: Sequence[str], quorum: str) -> bool:
    """The quorum rule: `view` (the nodes proposed to go on) may follow the decided `prev`
    when it holds more than half of it, or exactly half including prev's first node. Two sides
    of a partition can then never both continue. "none" lets any non-empty view continue (e.g.
    to survive losing 2 of 4 nodes at once) at the price of split-brain under a partition."""
    if not view:
        return False
    if quorum == "none":
        return True
    return 2 * len(view) > len(prev) or (2 * len(view) == len(prev) and prev[0] in view)


@functools.lru_cache(maxsize=16)
def shared(nodes: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple object per distinct view in this process: the agents of a simulation (thousands
    in one process, oobleck_hpc/testing/netsim.py) hold one copy of each view, not one each."""
    return nodes


@functools.lru_cache(maxsize=16)
def member_set(nodes: tuple[str, ...]) -> frozenset[str]:
    """The nodes of a view as a set, shared like `shared`."""
    return frozenset(nodes)


@dataclass(frozen=True)
class Decision:
    """One agreed generation: the nodes in it (roster order) and where its store lives."""

    gen: int
    nodes: tuple[str, ...]
    lost: tuple[str, ...]
    """Nodes of the previous generation that are not in this one."""
    store_node: str
    """The node whose worker hosts this generation's rendezvous store (first node in `nodes`)."""
    store_port: int
    joined: tuple[str, ...] = ()
    """Nodes of this generation that were not in the previous one (joins, step 7)."""

    def to_msg(self) -> dict[str, Any]:
        return {"gen": self.gen, "nodes": list(self.nodes), "lost": list(self.lost),
                "store_node": self.store_node, "store_port": self.store_port,
                "joined": list(self.joined)}

    @classmethod
    def from_msg(cls, m: dict[str, Any]) -> Decision:
        return cls(m["gen"], shared(tuple(m["nodes"])), tuple(m["lost"]), m["store_node"],
                   m["store_port"], tuple(m.get("joined", ())))
