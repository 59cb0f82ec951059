"""The all-gathers among a generation's nodes that ride on the control plane
(`MembershipCore.exchange`: the commit vote, plan digests, a recovery's reconcile). Bookkeeping
only: the core decides when one completes (this node's value and every node of the current view's
are in, no round open) and when it fails (a round opened first, this node was fenced)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from oobleck_hpc.elastic.decision import Decision


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


class ExchangeSteps:
    """Step 8 of the membership protocol (membership.py), a part of MembershipCore kept here:
    each member sends its value to the view's first node, which sends all of them back."""

    me: str
    decided: Decision
    proposal: tuple[str, ...] | None
    fenced: str | None
    joined: bool
    outbox: list[tuple[str, dict[str, Any]]]
    notes: list[tuple[str, dict[str, Any]]]
    _x: Exchanges

    def exchange(self, key: str, value: Any, gen: int | None = None) -> None:
        """Contribute `value` to the all-gather `key` among the nodes of generation `gen` (by
        default the current one). Completes with note ('exchange_done', {gen, key, values:
        {node: value}}) or ('exchange_failed', {gen, key, reason}) if a round starts first --
        at once when `gen` is not the current generation (the caller's view is out of date)."""
        gen = self.decided.gen if gen is None else gen
        if self.fenced or self.proposal is not None or not self.joined or gen != self.decided.gen:
            reason = self.fenced or ("not a member yet" if not self.joined else
                                     "membership round open" if self.proposal is not None else
                                     f"membership moved on (generation {self.decided.gen})")
            self.notes.append(("exchange_failed", {"gen": gen, "key": key, "reason": reason}))
            return
        self._x.put(gen, key, self.me, value, mine=True)
        coordinator = self.decided.nodes[0]  # it gathers and tells everyone (step 8)
        if coordinator != self.me:
            self.outbox.append((coordinator, {"type": "exchange", "xgen": gen, "key": key,
                                              "value": value}))
        self._check_exchange(gen, key)

    def _on_exchange(self, src: str, msg: dict[str, Any]) -> None:
        if msg["xgen"] >= self.decided.gen:
            self._x.put(msg["xgen"], msg["key"], src, msg["value"])
            self._check_exchange(msg["xgen"], msg["key"])

    def _on_exchange_done(self, src: str, msg: dict[str, Any]) -> None:
        """The coordinator's gathered values (step 8)."""
        gen = msg["xgen"]
        if gen == self.decided.gen:  # (it needed this node's value: no later generation)
            self._x.put_all(gen, msg["key"], msg["values"], but=self.me)
            self._check_exchange(gen, msg["key"])

    def _check_exchange(self, gen: int, key: str) -> None:
        if gen != self.decided.gen or self.proposal is not None:
            return
        values = self._x.take(gen, key, self.decided.nodes)
        if values is not None:
            if self.decided.nodes[0] == self.me:
                done = {"type": "exchange_done", "xgen": gen, "key": key, "values": values}
                for node in self.decided.nodes[1:]:
                    self.outbox.append((node, done))
            self.notes.append(("exchange_done", {"gen": gen, "key": key, "values": values}))

    def _fail_exchanges(self, reason: str) -> None:
        for gen, key in self._x.abandon():
            self.notes.append(("exchange_failed", {"gen": gen, "key": key, "reason": reason}))
