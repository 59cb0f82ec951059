"""The all-gathers among a generation's nodes that ride on the control plane
(`MembershipCore.exchange`: the commit vote, plan digests, a recovery's reconcile). Bookkeeping
only: the core decides when one completes (this node's value and every node of the current view's
are in, no round open) and when it fails (a round opened first, this node was fenced).

What it takes (a vote carries the drain, stop and straggler decisions): one value per node per
key, the first (a second is ignored); values only at the coordinator of the current generation
and only from its members, or for the next generation (a member that decided it first); at
most OPEN_PER_NODE keys open per node and generation; the gathered values only from the
coordinator of the current generation, for its members."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from oobleck_hpc.control.decision import Decision

BOUNDARY = "commit-"
"""Keys of the exchanges that end a step: the workers' commit vote (recovery/driver.py). Once
one completes, every member holds its values before any later message: a step boundary
(membership.py, step 7b)."""

OPEN_PER_NODE = 4
"""Exchanges one node may have values in, per generation, that have not completed here: a
member is at most a step ahead (its vote, a drain's exchange); more is not a member's."""


class Exchanges:
    def __init__(self) -> None:
        self._values: dict[tuple[int, str], dict[str, Any]] = {}
        self._mine: set[tuple[int, str]] = set()

    def put(self, gen: int, key: str, node: str, value: Any, mine: bool = False) -> None:
        """`node`'s value for exchange `key` of generation `gen` (`mine`: this node's own);
        ignored if `node` gave one already, or has OPEN_PER_NODE other keys open."""
        if mine:
            self._mine.add((gen, key))
        values = self._values.get((gen, key), {})
        if node in values or sum(1 for (g, _), v in self._values.items()
                                 if g == gen and node in v) >= OPEN_PER_NODE:
            return
        self._values.setdefault((gen, key), values)[node] = value

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

    def waiting(self, gen: int) -> list[str]:
        """The keys of generation `gen`'s exchanges that this node gave its value to and that
        have not completed here."""
        return [key for g, key in self._mine if g == gen]

    def missing(self, gen: int, key: str, nodes: Sequence[str]) -> list[str]:
        """The nodes of `nodes` whose values for exchange `key` are not in here."""
        values = self._values.get((gen, key), {})
        return [n for n in nodes if n not in values]

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

    def step_boundary(self) -> None:  # (MembershipCore's)
        raise NotImplementedError

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

    def waiting_exchanges(self) -> list[str]:
        """The keys of this node's exchanges of the current generation that wait (none while
        a round is open)."""
        if self.fenced or self.proposal is not None:
            return []
        return self._x.waiting(self.decided.gen)

    def exchange_waits_on(self, key: str) -> list[str]:
        """The nodes exchange `key` of the current generation waits on, as far as this node can
        tell: at the view's coordinator, the members whose values are not in; elsewhere, the
        coordinator, which gathers them (control/stall_probe.py probes them)."""
        d = self.decided
        return self._x.missing(d.gen, key, d.nodes) if d.nodes[0] == self.me else [d.nodes[0]]

    def _on_exchange(self, src: str, msg: dict[str, Any]) -> None:
        gen, d = msg["xgen"], self.decided
        if gen == d.gen + 1 or (gen == d.gen and d.nodes[0] == self.me and src in d.nodes):
            self._x.put(gen, msg["key"], src, msg["value"])
            self._check_exchange(gen, msg["key"])

    def _on_exchange_done(self, src: str, msg: dict[str, Any]) -> None:
        """The coordinator's gathered values (step 8)."""
        gen, d = msg["xgen"], self.decided
        if gen == d.gen and src == d.nodes[0]:  # (it needed this node's value: not later)
            values = {n: v for n, v in msg["values"].items() if n in d.nodes}
            self._x.put_all(gen, msg["key"], values, but=self.me)
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
            if key.startswith(BOUNDARY):
                self.step_boundary()

    def _fail_exchanges(self, reason: str) -> None:
        for gen, key in self._x.abandon():
            self.notes.append(("exchange_failed", {"gen": gen, "key": key, "reason": reason}))
