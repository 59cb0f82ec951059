"""The control plane's protocol at thousands of agents: the agents' own code -- `MembershipCore`
(control/membership.py) and `Monitor` (control/topology.py), exactly as plane.py drives them
-- on a discrete-event model of the network, every agent in this one process.

Network model (`NetModel`): a message takes latency_s plus a uniform jitter up to jitter_s,
delivered in order per pair (TCP); with probability `loss` a segment is lost and TCP resends it
after rto_s. A path can be cut (one direction, or both across a partition): its messages are
dropped, and the sender's link fails after connect_timeout_s (links.py: the connect timeout),
once per pair. A crashed agent's connections close: each peer that had one open sees it after
one delay plus the liveness check (plane.py `reach`: two round trips). A stopped agent (SIGSTOP)
runs nothing and its messages wait in the kernel until it resumes.

What is measured (`Sim.run_scenario`):
- detect_s: the failure -> the first suspicion of a failed node made by an agent itself (not
  relayed);
- agree_s: the failure -> the last expected survivor deciding the expected view;
- msgs_per_agent_per_s_steady: messages sent per agent and second before the failure;
- msgs_per_event_per_agent: messages sent from the failure to the agreement, beyond the steady
  rate, per agent;
- safe: two agents that decided the same generation, each in the other's view, decided the same
  view (the protocol's safety claim), checked on every decision.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from oobleck_hpc.config import HEARTBEAT_S, LEASE_S
from oobleck_hpc.control.membership import Decision, MembershipCore
from oobleck_hpc.control.topology import MONITORS, Monitor


@dataclass
class NetModel:
    latency_s: float = 100e-6
    jitter_s: float = 100e-6
    loss: float = 0.0
    rto_s: float = 0.2
    connect_timeout_s: float = 3.0

    @property
    def mean_delay_s(self) -> float:
        return self.latency_s + self.jitter_s / 2 + self.loss * self.rto_s


@dataclass
class Sim:
    """`n` agents n0..n{n-1}, all started at time 0 (the roster is generation 0)."""

    n: int
    net: NetModel = field(default_factory=NetModel)
    seed: int = 0
    heartbeat_s: float = HEARTBEAT_S
    lease_s: float = LEASE_S
    k: int = MONITORS
    hold_s: float = 1e-3
    """How long a coordinator holds the first re-broadcast of a changed proposal in a round,
    doubled for each further one (plane.py: HOLD_S; membership.py: hold_rebroadcasts)."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.names = tuple(f"n{i}" for i in range(self.n))
        ports = itertools.count(20000)
        self.cores = {m: MembershipCore(m, self.names, 1, lambda: next(ports),
                                        hold_rebroadcasts=True) for m in self.names}
        self.monitors = {m: Monitor(c, self.heartbeat_s, self.lease_s, startup_s=self.lease_s,
                                    k=self.k) for m, c in self.cores.items()}  # plane.py's
        self.now = 0.0
        self._q: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._held: set[str] = set()  # coordinators whose re-broadcast is held (a flush due)
        self.crashed: set[str] = set()
        self.stopped: dict[str, float] = {}  # agent -> when it resumes
        self.cut: Callable[[str, str], bool] = lambda a, b: False
        self._failed_paths: set[tuple[str, str]] = set()
        self._last: dict[tuple[str, str], float] = {}
        self.connected: dict[str, set[str]] = {m: set() for m in self.names}
        self.sent = 0
        self.suspected_at: dict[str, float] = {}  # node -> first own (not relayed) suspicion
        self.unsafe: list[str] = []
        self._by_view: dict[tuple[str, ...], dict[str, float]] = {}  # view -> decider -> when
        self._by_gen: dict[int, dict[Decision, list[str]]] = {}
        for m in self.names:
            self.monitors[m].start(0.0)
            self._push(self.rng.uniform(0, self.heartbeat_s / 2), "tick", m)

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._q, (t, next(self._seq), kind, payload))

    def run_until(self, t_end: float) -> None:
        while self._q and self._q[0][0] <= t_end:
            t, _, kind, payload = heapq.heappop(self._q)
            self.now = t
            if kind == "tick":
                self._tick(payload)
            elif kind == "deliver":
                self._deliver(*payload)
            elif kind == "flush":
                self._held.discard(payload)
                if self._running(payload):
                    resume = self.stopped.get(payload)
                    if resume is not None and resume > self.now:
                        self._held.add(payload)
                        self._push(resume, "flush", payload)
                    else:
                        self.cores[payload].flush()
                        self._flush(payload)
            elif kind == "stop":
                self.stop(*payload)
            elif kind == "detect":
                observer, node, how = payload
                if self._running(observer):
                    self.cores[observer].suspect(node, how)
                    self._flush(observer)
        self.now = t_end

    def _running(self, m: str) -> bool:
        return m not in self.crashed and self.cores[m].fenced is None

    def _tick(self, m: str) -> None:
        if m in self.crashed:
            return
        resume = self.stopped.get(m)
        if resume is not None and resume > self.now:
            self._push(resume, "tick", m)  # its ticker is not scheduled until it resumes
            return
        self.stopped.pop(m, None)
        self.monitors[m].tick(self.now)
        self._flush(m)
        if self.cores[m].fenced is None:
            self._push(self.now + self.heartbeat_s / 2, "tick", m)

    def _deliver(self, src: str, dst: str, msg: dict[str, Any]) -> None:
        if not self._running(dst):
            return
        resume = self.stopped.get(dst)
        if resume is not None and resume > self.now:
            self._push(resume + 1e-6, "deliver", (src, dst, msg))  # waits in the kernel
            return
        if not self.monitors[dst].message(src, msg, self.now):
            self.cores[dst].handle(src, msg)
        self._flush(dst)

    def _send(self, src: str, dst: str, msg: dict[str, Any]) -> None:
        self.sent += 1
        if dst in self.crashed:
            return  # its connections are closed: the crash's detection covers it
        if self.cut(src, dst):
            if (src, dst) not in self._failed_paths:
                self._failed_paths.add((src, dst))
                self._push(self.now + self.net.connect_timeout_s, "detect",
                           (src, dst, "send_failed (timed out)"))
            return
        self.connected[src].add(dst)
        self.connected[dst].add(src)
        delay = self.net.latency_s + self.rng.uniform(0, self.net.jitter_s)
        if self.net.loss and self.rng.random() < self.net.loss:
            delay += self.net.rto_s
        t = max(self.now + delay, self._last.get((src, dst), 0.0) + 1e-9)
        self._last[(src, dst)] = t
        self._push(t, "deliver", (src, dst, msg))

    def _flush(self, m: str) -> None:
        core = self.cores[m]
        for dst, msg in core.outbox:
            self._send(m, dst, msg)
        core.outbox.clear()
        if core.held and m not in self._held:  # plane.py's HOLD_S, in simulated time
            self._held.add(m)
            self._push(self.now + core.hold_delay(self.hold_s, self.lease_s / 2), "flush", m)
        for kind, fields in core.notes:
            if kind == "suspect" and "via " not in fields["how"]:
                self.suspected_at.setdefault(fields["node"], self.now)
            elif kind == "decided":
                self._decided(m, Decision.from_msg(fields))
        core.notes.clear()

    def _decided(self, m: str, d: Decision) -> None:
        deciders = self._by_view.setdefault(d.nodes, {})
        deciders[m] = self.now
        # The safety claim, against every other decision of this generation (there are few).
        for e, others in self._by_gen.setdefault(d.gen, {}).items():
            if e != d and m in e.nodes:
                bad = [o for o in others if o in deciders or o in set(d.nodes)]
                if bad:
                    self.unsafe.append(f"generation {d.gen}: {m} decided {d}, {bad[0]} {e}")
        self._by_gen[d.gen].setdefault(d, []).append(m)

    # ------------------------------------------------------------------ faults

    def crash(self, nodes: list[str]) -> None:
        for x in nodes:
            self.crashed.add(x)
        for x in nodes:
            for peer in self.connected[x]:
                if peer not in self.crashed:
                    t = self.now + self.net.latency_s * 5 + self.rng.uniform(0, self.net.jitter_s)
                    self._push(t, "detect", (peer, x, "connection_lost"))

    def stop(self, node: str, seconds: float) -> None:
        self.stopped[node] = self.now + seconds

    # ------------------------------------------------------------------ scenario

    def agreed(self, view: tuple[str, ...]) -> float | None:
        """When the last of `view` decided exactly `view` (None: not all of them yet)."""
        deciders = self._by_view.get(view, {})
        return max(deciders.values()) if len(deciders) == len(view) else None

    def run_scenario(self, name: str, fault: Fault, steady_s: float = 2.0,
                     bound_s: float = 30.0) -> dict[str, Any]:
        """Settle (one lease), measure `steady_s` of failure-free load, apply `fault` (returns
        the faulty nodes and the view the survivors must agree on), run until they do (at most
        `bound_s`). A view None: nothing may change -- run `bound_s`, then no agent may have
        decided a new generation or been fenced."""
        self.run_until(self.lease_s)
        before = self.sent
        self.run_until(self.lease_s + steady_s)
        steady = (self.sent - before) / self.n / steady_s
        t0, sent0 = self.now, self.sent
        failed, view = fault(self)
        done = None
        if view is None:
            self.run_until(t0 + bound_s)
            calm = not self._by_gen and all(
                c.fenced is None for c in self.cores.values())
            failed = [x for x in failed if x in self.suspected_at]  # none, if calm
            done = t0 if calm else None
        while done is None and view is not None and self.now < t0 + bound_s:
            self.run_until(self.now + 0.05)
            done = self.agreed(view)
        detect = min((self.suspected_at[x] for x in failed if x in self.suspected_at),
                     default=math.nan)
        agree = (done - t0) if done is not None else math.nan
        extra = (self.sent - sent0) - steady * self.n * (self.now - t0)

        def num(x: float, digits: int) -> float | None:  # JSON has no NaN
            return None if math.isnan(x) else round(x, digits)

        return {"nodes": self.n, "scenario": name, "detect_s": num(detect - t0, 4),
                "agree_s": num(agree, 4),
                "agree_after_detect_delays": num((agree - (detect - t0))
                                                 / self.net.mean_delay_s, 1),
                "msgs_per_agent_per_s_steady": round(steady, 2),
                "msgs_per_event_per_agent": round(max(0.0, extra) / self.n, 2),
                "live": done is not None, "safe": not self.unsafe}


Fault = Callable[[Sim], tuple[list[str], "tuple[str, ...] | None"]]


def survivors(sim: Sim, failed: list[str]) -> tuple[str, ...]:
    gone = set(failed)
    return tuple(m for m in sim.names if m not in gone)


def scenarios(f: int = 3, switch: int = 32) -> dict[str, Fault]:
    """The issue's failure scenarios: each returns (failed nodes, the survivors' view)."""

    def one_crash(sim: Sim):
        x = [sim.names[sim.n // 2]]
        sim.crash(x)
        return x, survivors(sim, x)

    def f_crashes(sim: Sim):
        x = sim.rng.sample(sim.names[1:], f)
        sim.crash(x)
        return x, survivors(sim, x)

    def switch_down(sim: Sim):  # the nodes behind one switch: consecutive in the roster
        start = sim.n // 3
        x = list(sim.names[start:start + switch])
        sim.crash(x)
        return x, survivors(sim, x)

    def hang(sim: Sim):
        x = [sim.names[sim.n // 4]]
        sim.stop(x[0], math.inf)
        return x, survivors(sim, x)

    def coordinator_crash(sim: Sim):
        x = [sim.names[0]]
        sim.crash(x)
        return x, survivors(sim, x)

    def flapping(sim: Sim):
        """Stopped for 60 % of a lease, then running half a second, four times: always under
        the lease, so nobody may be excluded (view None: nothing may change)."""
        x, t = sim.names[sim.n // 5], sim.now
        for _ in range(4):
            sim._push(t, "stop", (x, 0.6 * sim.lease_s))
            t += 0.6 * sim.lease_s + 0.5
        return [x], None

    def partition(sim: Sim):
        side = {m: i >= (2 * sim.n) // 3 for i, m in enumerate(sim.names)}
        sim.cut = lambda a, b: side[a] != side[b]
        minority = [m for m in sim.names if side[m]]
        return minority, survivors(sim, minority)

    return {"one_crash": one_crash, f"{f}_crashes": f_crashes, f"switch_{switch}": switch_down,
            "hang": hang, "coordinator_crash": coordinator_crash, "flapping": flapping,
            "partition": partition}
