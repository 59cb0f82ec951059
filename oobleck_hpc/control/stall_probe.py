"""The agent's answer to a worker's stall: ping the nodes it waits on, suspect the silent ones.

A worker that waits inside a step's communication far longer than its usual step reports a
stall (recovery/stall.py), naming the nodes it waits on when it knows them. Its agent
(control/agent.py) calls `ControlPlane.stalls.probe`: each named node's agent (every member's
when none is named) gets a PING, and a node not heard from within `timeout_s` (STALL_PROBE_S)
is suspected at once -- its agent does not even answer a ping: the node is stopped, frozen or
cut off (the ordinary round follows, as for a kill). A node that answers is left alone, and if
every one answers nothing happens at all: no retry round (unlike the probe after a
communication error, control/plane.py `probe`), because a node slow to arrive in a collective is
a straggler (recovery/straggler.py), not a failure, and replaying its step would not make it
faster. The lease still bounds a wait on a node whose agent answers but whose workers do not
arrive.

A silence means something only if it is one node's while others answer: under a CPU hog the
prober may be the one descheduled, or several agents at once, and a node that suspected all it
pinged would propose a view of itself alone and fence (chaos seed 2818, trial 3; in a CI run
two healthy agents were silent for 0.35 s together and the job fell back). So a stall that
names its suspects also pings up to WITNESSES other members, and a probe suspects its silent
node only if it is the only one and some node answered or was heard from since the ping (a
witness is never suspected by it). Otherwise it suspects nobody (`unconfirmed` in its event)
and leaves the silent nodes to their observers' leases, which need most observers to agree: two
nodes hung at once are found by their leases.

The deadline is the one figure a healthy node's place depends on: a false suspicion costs a
healthy node. It is short next to the lease but long next to a live agent's answer, which the
`stall_probed` event records per node (`answered_s`). A node pinged and not yet answered or
timed out is not pinged again (every worker of every survivor may report the same stall). As
the probe after an error, nothing is done while a round is open (it explains the stall, and it
waits at most lease_s for a hung member) or for an older generation.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oobleck_hpc.control.plane import ControlPlane

WITNESSES = 2
"""Members not named by a stall that its probe pings too: one answer shows that this agent is
heard and hears (module docstring)."""


class StallProbes:
    """The stall probes of one agent's control plane (module docstring). Runs under the plane's
    lock; its deadlines on the plane's event loop."""

    def __init__(self, plane: ControlPlane, timeout_s: float):
        self.plane, self.timeout_s = plane, timeout_s
        self._pinged: dict[str, tuple[float, float | None]] = {}
        """Nodes pinged and not yet judged: node -> (pinged at, answered at)."""

    def probe(self, suspects: list[str], why: str, gen: int) -> None:
        """A worker of this node stalled in generation `gen` waiting on `suspects` (empty: it
        does not know on whom): ping them, judge them `timeout_s` later."""
        cp = self.plane
        with cp._lock:
            core = cp.core
            if core.fenced or cp._loop is None:
                return
            if gen < core.decided.gen or core.proposal is not None:
                cp.events.emit("probe_skipped", why=why, failed_gen=gen, gen=core.decided.gen,
                               round_open=core.proposal is not None)
                return
            gone = core.suspects.keys() | core.left | self._pinged.keys()
            live = [n for n in core.decided.nodes if n != cp.me and n not in gone]
            nodes = [n for n in suspects or live if n in live]
            witnesses = [n for n in live if n not in nodes][:WITNESSES]
            now = time.monotonic()
            for node in nodes + witnesses:
                self._pinged[node] = (now, None)
                cp._link(node).put({"type": "ping"})
            if nodes:
                cp._loop.after(self.timeout_s, functools.partial(
                    self._judge, nodes, witnesses, now, core.decided.gen, why))

    def heard(self, src: str, msg: dict[str, Any]) -> None:
        """A message from `src` (called with the plane's lock held): a PONG answers its ping."""
        if msg.get("type") == "pong" and self._pinged.get(src, (0.0, 0.0))[1] is None:
            self._pinged[src] = (self._pinged[src][0], time.monotonic())

    def _judge(self, nodes: list[str], witnesses: list[str], started: float, gen: int,
               why: str) -> None:
        """`timeout_s` after `nodes` and `witnesses` were pinged: suspect the one node not
        heard from since, if another was (module docstring)."""
        cp = self.plane
        with cp._lock:
            answered = {n: self._pinged.pop(n, (started, None))[1] for n in nodes + witnesses}
            core = cp.core
            if core.fenced or core.decided.gen != gen or core.proposal is not None:
                return  # a round or a decision came first: it answers for the stall
            heard = {n for n in core.decided.nodes if n != cp.me and (
                answered.get(n) is not None or cp.detector.last_heard.get(n, 0.0) >= started)}
            silent = [n for n in nodes if n not in heard and n not in core.suspects]
            unconfirmed = not heard or len(silent) > 1
            cp.events.emit("stall_probed", why=why, nodes=nodes, silent=silent,
                           witnesses=witnesses, unconfirmed=unconfirmed, timeout_s=self.timeout_s,
                           answered_s={n: round(t - started, 4) for n, t in answered.items()
                                       if t is not None})
            if unconfirmed:
                return
            for node in silent:
                cp._run(functools.partial(core.suspect, node, f"stall_probe_unanswered (within "
                                          f"{self.timeout_s} s)"))
