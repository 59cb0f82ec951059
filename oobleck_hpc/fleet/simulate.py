"""The fleet on failure traces: the manager's decision against every job healing on its own.

One trace (sim/trace.py) is replayed on a pool shared by several jobs, under three policies:

fleet    the manager (issue 32): each job runs oobleck's in-place recovery (sim/policies.py's
         OobleckPolicy); after a job's loss, once its recovery is over, the manager re-solves
         the allocation with the same decision as `fleet plan` (allocate.decide: each job's
         current count, moves charged transition_s x its WAF over the pool's MTBF) and, when a
         move pays, drains nodes from the jobs that lose them (OobleckPolicy.on_drain: a
         planned shrink, nothing replayed) and grows the others (on_add: a join). A node that
         arrives (repaired, replaced) goes to the free pool and the manager places it at once;
         a job below its minimum stops at its checkpoint and restarts when nodes are given.
own      every job on its own (today): each job keeps its nodes and recovers in place
         (OobleckPolicy); an arriving node returns to the job furthest below its starting count
         (its owner, repaired), or idles when none is.
restart  the same ownership, each job checkpoint-restarting (RestartPolicy).

All three start from the same allocation: the manager's decision on the whole pool (a fresh
plan, nothing moves). So the comparison is of what happens after failures only; a baseline of
badly sized jobs would flatter the manager. `ceiling_waf` is the bound no policy passes on a
trace (at every moment the decision on the nodes alive, free of cost): what a manager could
gain at most.

Each job's throughput on n nodes is its curve (curves.py: its planner's samples/s), run as a
sim/scenario.TableBackend; its in-place recovery and its join each pause it transition_s (the
same cost the decision charges), a restart pauses it restart_s, checkpoints follow Young/Daly
(planner_backend.young_daly) at the job's share of the trace's failure rate. WAF(t) = sum over
jobs of weight x FLOPs per sample x goodput(t) (work later thrown away counts 0).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from oobleck_hpc.fleet.allocate import JobCurve, decide
from oobleck_hpc.fleet.config import FleetConfig
from oobleck_hpc.sim.engine import Policy, PolicyResult, mean_over_windows
from oobleck_hpc.sim.planner_backend import young_daly
from oobleck_hpc.sim.policies import OobleckPolicy, RestartPolicy
from oobleck_hpc.sim.scenario import PolicyTable, TableBackend
from oobleck_hpc.sim.trace import Trace

FLEET_POLICIES = ("fleet", "own", "restart")


@dataclass(frozen=True)
class SimJob:
    """One job of a simulated fleet: its curve, what weighs it, and its recovery costs."""

    name: str
    weight: float
    flops_per_sample: float
    samples_per_s: np.ndarray
    """samples/s on n nodes, n = 0..len-1 (0: no plan)."""
    samples: float
    """Samples per iteration (the global batch)."""
    min_nodes: int = 1
    max_nodes: int | None = None
    transition_s: float = 60.0
    """Pause of an in-place recovery or a join (as the decision charges it)."""
    restart_s: float = 120.0
    """Pause of a restart from the checkpoint (requeue, launch, reload)."""
    checkpoint_s: float = 10.0
    """Blocking part of a synchronous checkpoint (checkpoint-restart)."""
    snapshot_s: float = 1.0
    """Blocking part of oobleck's asynchronous checkpoint (the state to host memory)."""
    f: int = 1

    @property
    def waf(self) -> np.ndarray:
        return self.weight * self.flops_per_sample * self.samples_per_s

    def curve(self, current: int | None) -> JobCurve:
        return JobCurve(self.name, self.waf, self.min_nodes, self.max_nodes, self.transition_s,
                        current)

    def backend(self) -> TableBackend:
        top = len(self.samples_per_s) - 1 if self.max_nodes is None else self.max_nodes
        table = {n: float(v) for n, v in enumerate(self.samples_per_s)
                 if v > 0 and self.min_nodes <= n <= top}
        if not table:  # never runs: a table needs one entry, past any count it can get
            table = {len(self.samples_per_s) + 1: 1.0}
        return TableBackend(PolicyTable(table, restart_s=self.restart_s,
                                        reconfiguration_s=self.transition_s, f=self.f),
                            self.samples)


@dataclass
class FleetResult:
    policy: str
    duration_s: float
    jobs: dict[str, PolicyResult]
    waf_per_sample: dict[str, float]
    """weight x FLOPs per sample of each job: its goodput (samples/s) times this is its WAF."""
    moves: int = 0
    """Nodes the manager moved from one job to another (or gave from the free pool)."""
    nodes: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    """(time_s, each job's node count) at every change."""

    @property
    def mean_waf(self) -> float:
        return sum(self.waf_per_sample[k] * r.samples_per_s for k, r in self.jobs.items())

    def job_waf(self) -> dict[str, float]:
        return {k: self.waf_per_sample[k] * r.samples_per_s for k, r in self.jobs.items()}

    def waf_windows(self, window_s: float) -> list[tuple[float, float, float]]:
        """The fleet's WAF averaged over consecutive windows (start_s, end_s, WAF)."""
        out: list[tuple[float, float, float]] = []
        for k, r in self.jobs.items():
            wins = mean_over_windows(r.goodput, self.duration_s, window_s)
            scale = self.waf_per_sample[k]
            out = ([(a, b, w * scale) for a, b, w in wins] if not out else
                   [(a, b, s + w * scale) for (a, b, s), (_, _, w) in zip(out, wins)])
        return out

    def to_dict(self, window_s: float) -> dict:
        return {"policy": self.policy, "mean_waf": self.mean_waf, "job_waf": self.job_waf(),
                "moves": self.moves,
                "failures": sum(r.failures for r in self.jobs.values()),
                "fallbacks": sum(r.fallbacks for r in self.jobs.values()),
                "waf_windows": [list(w) for w in self.waf_windows(window_s)],
                "nodes": [[t, list(c)] for t, c in self.nodes],
                "jobs": {k: {"samples": r.samples, "samples_per_s": r.samples_per_s,
                             "shares": r.shares, "notes": r.notes}
                         for k, r in self.jobs.items()}}


class FleetSim:
    """The pool: which job owns which node, the free nodes, and one engine policy per job."""

    def __init__(self, jobs: list[SimJob], policy: str, horizon_s: float, job_mtbf_s: float):
        if policy not in FLEET_POLICIES:
            raise ValueError(f"unknown fleet policy {policy!r}: use one of {FLEET_POLICIES}")
        self.jobs, self.policy, self.horizon_s = jobs, policy, horizon_s
        self.job_mtbf_s = job_mtbf_s
        self.runs: list[Policy] = []
        self.owner: dict[str, int] = {}
        self.free: list[str] = []
        self.start_counts: list[int] = []
        self.moves = 0
        self.nodes: list[tuple[float, tuple[int, ...]]] = []

    def _policy(self, job: SimJob, count: int) -> Policy:
        """The job's engine policy, checkpointing at Young/Daly for its share of the failures
        (count nodes of the pool's per-node MTBF) as if every failure needed the checkpoint:
        oobleck's checkpoints block only for `snapshot_s`, and a pool's failures are not
        independent (a burst beyond f falls back to the checkpoint), so the single-job
        simulator's interval (f + 1 failures in one window: days) would bet the week on it."""
        mtbf = self.job_mtbf_s / max(count, 1)
        if self.policy == "restart":
            return RestartPolicy(job.backend(), **young_daly(job.checkpoint_s, mtbf, 1.0, 0))
        return OobleckPolicy(job.backend(), **young_daly(job.snapshot_s, mtbf, 1.0, 0))

    def start(self, nodes: tuple[str, ...]) -> None:
        counts = decide([j.curve(None) for j in self.jobs], len(nodes)).nodes
        self.start_counts = list(counts)
        left = list(nodes)
        for i, (job, k) in enumerate(zip(self.jobs, counts)):
            mine, left = left[:k], left[k:]
            self.owner.update(dict.fromkeys(mine, i))
            run = self._policy(job, k)
            run.start(tuple(mine))
            self.runs.append(run)
        self.free = left
        self.record(0.0)

    def record(self, t: float) -> None:
        counts = tuple(len(r.alive) for r in self.runs)
        if not self.nodes or self.nodes[-1][1] != counts:
            self.nodes.append((t, counts))

    def advance_to(self, t: float) -> None:
        for run in self.runs:
            run.advance_to(t)

    def fail(self, node: str) -> float:
        """A node dies; returns when the manager should re-decide (after the job's recovery)."""
        j = self.owner.pop(node, None)
        if j is None:
            if node in self.free:
                self.free.remove(node)
            return self.runs[0].t
        run = self.runs[j]
        run.failures += 1
        run.on_fail(node)
        return run.t + (run.phase_left if run.phase == "recover" else 0.0)

    def add(self, node: str) -> None:
        """A node arrives: free for the manager; back to its owner for the others."""
        if self.policy == "fleet":
            self.free.append(node)
            return
        short = [self.start_counts[i] - len(r.alive) for i, r in enumerate(self.runs)]
        if max(short, default=0) <= 0:
            self.free.append(node)
            return
        self._give(short.index(max(short)), [node])

    def _give(self, j: int, nodes: list[str]) -> None:
        for node in nodes:
            self.owner[node] = j
            self.runs[j].on_add(node)

    def rebalance(self) -> None:
        """The manager: re-solve on every node alive, then drain and grow to the decision."""
        if self.policy != "fleet":
            return
        counts = [len(r.alive) for r in self.runs]
        total = sum(counts) + len(self.free)
        decision = decide([j.curve(c) for j, c in zip(self.jobs, counts)], total,
                          self.horizon_s)
        for j, (now, want) in enumerate(zip(counts, decision.nodes)):
            if want < now:
                run = self.runs[j]
                assert isinstance(run, OobleckPolicy)
                drained = tuple(run.alive[want:])
                for node in drained:
                    del self.owner[node]
                run.on_drain(drained)
                self.free += drained
        for j, (now, want) in enumerate(zip(counts, decision.nodes)):
            if want > now:
                given, self.free = self.free[:want - now], self.free[want - now:]
                self.moves += len(given)
                self._give(j, given)


def simulate_fleet(jobs: list[SimJob], trace: Trace, duration_s: float, policy: str,
                   horizon_s: float) -> FleetResult:
    """Replay `trace` for `duration_s` on the fleet under `policy` (module docstring).
    horizon_s: the MTBF over which the manager's moves must pay."""
    fails = sum(1 for e in trace.events if e.kind == "fail" and e.time_s < duration_s)
    node_mtbf = len(trace.nodes) * duration_s / fails if fails else math.inf
    sim = FleetSim(jobs, policy, horizon_s, node_mtbf)
    sim.start(trace.nodes)
    pending: list[float] = []  # times the manager re-decides
    events = [e for e in trace.events if e.time_s < duration_s]
    i = 0
    while i < len(events) or pending:
        if pending and (i == len(events) or pending[0] <= events[i].time_s):
            t = heapq.heappop(pending)
            if t >= duration_s:
                pending.clear()
                continue
            sim.advance_to(t)
            sim.rebalance()
        else:
            ev = events[i]
            i += 1
            sim.advance_to(ev.time_s)
            if ev.kind == "fail" and (ev.node in sim.owner or ev.node in sim.free):
                heapq.heappush(pending, sim.fail(ev.node))
            elif ev.kind == "add" and ev.node not in sim.owner and ev.node not in sim.free:
                sim.add(ev.node)
                heapq.heappush(pending, ev.time_s)
        sim.record(sim.runs[0].t if sim.runs else 0.0)
    sim.advance_to(duration_s)
    results = {j.name: r.result(duration_s) for j, r in zip(jobs, sim.runs)}
    return FleetResult(policy, duration_s, results,
                       {j.name: j.weight * j.flops_per_sample for j in jobs}, sim.moves,
                       sim.nodes)


def simulate_policies(jobs: list[SimJob], trace: Trace, duration_s: float, horizon_s: float,
                      policies: tuple[str, ...] = FLEET_POLICIES) -> dict[str, FleetResult]:
    return {p: simulate_fleet(jobs, trace, duration_s, p, horizon_s) for p in policies}


def ceiling_waf(jobs: list[SimJob], trace: Trace, duration_s: float) -> float:
    """The most WAF any policy can keep, on average, on this trace: at every moment the best
    allocation (allocate.decide: exact) of the nodes alive then, moved there at once and for
    free, with no pause and no checkpoint. A job trains on nodes alive only, and a pause or
    a checkpoint only subtracts from its goodput, so no policy's mean WAF exceeds it;
    ceiling / own bounds what any manager can gain over every job on its own on that trace."""
    curves = [j.curve(None) for j in jobs]
    best: dict[int, float] = {}
    alive, t, total = set(trace.nodes), 0.0, 0.0
    events = sorted((e for e in trace.events if e.time_s < duration_s), key=lambda e: e.time_s)
    for e in [*events, None]:
        until = duration_s if e is None else e.time_s
        n = len(alive)
        if n not in best:
            best[n] = decide(curves, n).total_waf
        total += best[n] * (until - t)
        if e is not None:
            (alive.add if e.kind == "add" else alive.discard)(e.node)
            t = until
    return total / duration_s


def fleet_jobs(path: str, nodes: int | None = None) -> tuple[FleetConfig, list[SimJob]]:
    """The fleet file's jobs as SimJobs: each one's curve from its planner (curves.py); a
    restart costs CostParams' restart_base_s plus reading its state at storage_bw, a
    checkpoint-restart checkpoint blocks for writing it, oobleck's for copying a GPU's share
    to host memory (planner_backend's models, with their defaults)."""
    from oobleck_hpc.fleet.config import load_fleet
    from oobleck_hpc.fleet.curves import job_curve
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.sim.planner_backend import CostParams

    fleet, entries = load_fleet(path, nodes)
    params = CostParams()
    out = []
    for fj in entries:
        c = job_curve(fj, fleet.pool.nodes)
        state = sum(layer.state_bytes for layer in resolve_profile(fj.job).layers)
        gpus = max(fj.entry.min_nodes, c.smallest or 1) * fj.job.cluster.gpus_per_node
        out.append(SimJob(fj.name, c.weight, c.flops_per_sample, c.samples_per_s,
                          float(fj.job.train.global_microbatches * fj.job.train.microbatch_size),
                          fj.entry.min_nodes, fj.entry.max_nodes, fj.entry.transition_s,
                          params.restart_base_s + state / params.storage_bw,
                          state / params.storage_bw, state / gpus / params.host_bw,
                          fj.job.fault_tolerance.f))
    return fleet, out
