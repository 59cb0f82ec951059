"""The all-gathers among a generation's nodes that ride on the control plane
(`MembershipCore.exchange`: the commit vote, plan digests, a recovery's reconcile). Bookkeeping
only: the core decides when one completes (this node's value and every node of the current view's
are in, no round open) and when it fails (a round opened first, this node was fenced)."""

from __future__ import annotations

from typing import Any, Sequence


class Exchanges:
    def __init__(self) -> None:
        self._values: dict[tuple[int, str], dict[str, Any]] = {}
        self._mine: set[tuple[int, str]] = set()

    def put(self, gen: int, key: str, node: str, value: Any, mine: bool = False) -> None:
        """`node`'s value for exchange `key` of generation `gen` (`mine`: this node's own)."""
        if mine:
            self._mine.add((gen, key))
        self._values.setdefault((gen, key), {})[node] = value

    def put_all(self, gen: int, key: str, values: dict[str, Any], but: str) -> None:
        """Every node's value but this node's own (`but`): a coordinator's gathered values."""
        for node, value in values.items():
            if node != but:
                self.put(gen, key, node, value)

    def take(self, gen: int, key: str, nodes: Sequence[str]) -> dict[str, Any] | None:
        """Every value of `nodes`, in their order, once this node's own and all of theirs are
        in (then the exchange is forgotten); else None."""
        values = self._values.get((gen, key), {})
        if (gen, key) not in self._mine or not all(n in values for n in nodes):
            return None
        self._mine.discard((gen, key))
        del self._values[(gen, key)]
        return {n: values[n] for n in nodes}

    def abandon(self) -> list[tuple[int, str]]:
        """This node's exchanges still open, which have failed: (gen, key), forgotten."""
        failed = sorted(self._mine)
        self._mine.clear()
        return failed

    def keys(self, gen: int) -> list[str]:
        return [key for g, key in self._values if g == gen]

    def forget_before(self, gen: int) -> None:
        for k in [k for k in self._values if k[0] < gen]:
            del self._values[k]
