"""The fleet manager's logic: the jobs' events in, the moves out (no processes, no files).

`oobleck-hpc fleet run` (launch/fleet.py) starts the jobs, feeds every event of each job's
RUN_DIR/events.jsonl to `Manager.on_event`, each job's end to `on_exit`, and enacts the
actions they return with the jobs' public operations: `Drain` (control/drain.request_drain),
`Grow` (launch/local.grow), `Start` (`oobleck-hpc run`). The manager writes each of its
decisions to the fleet's events (records/events.py, `fleet_*`) through `emit`.

What it reacts to, as fleet/simulate.py's FleetSim.rebalance does on traces:

- A node lost in job A: A recovers in place by itself; once A's recovery committed a step (its
  `recovered` event, nodes lost), the manager re-solves (allocate.decide, each job's current
  count, moves charged transition_s x WAF over the pool's MTBF). A job the decision shrinks
  is asked to drain nodes (its last members); once its `drain_agreed` shows them gone, the
  jobs the decision grows are grown by as many.
- A job that ends (finished or not): its nodes are free; the manager re-solves and grows the
  others, or starts a job that was waiting.
- A job that runs on fewer nodes than its min_nodes after a loss (its `plan_chosen`) is
  stopped at its checkpoint (`Stop`): it falls back as below, its nodes free for the others.
- A job that falls back to its checkpoint (its launcher exits 75, errors.EXIT_REQUEUE: fewer
  nodes than any plan needs, or stopped as above): its nodes are free and it waits again;
  every decision from then on counts it as a waiting job, and it is started again (`Start`
  with its next attempt number: it resumes from its checkpoint) once it gets nodes -- at once,
  if the pool has enough free, else when a job ends or gives nodes back.

A move's cost is each job's own pause, measured: the `seconds` of its `recovered` events (a
loss, a drain or a join: the fault or the agreement -> its first committed step), their median;
until a job has one, the fleet file's transition_s stands in.

Its state is explicit: `snapshot()` is a JSON document of everything the events changed (each
job's counts, members, targets, pauses; the free nodes, the drains under way, the triggers
waiting), `restore()` takes it back, so a manager restarted from its records (launch/fleet.py)
goes on from the same state with the events that came since.

Limits, designed within: a grown node (local, or on Slurm) joins only while its job runs below the node
count it started with (control/membership.py), else it waits as a spare. So the decision never
gives a running job more than it started with (its max_nodes is capped there): nodes freed by a
job that ends go to jobs that lost nodes, or to a waiting job, else they stay idle. A running
job is never stopped (a decision that would give it 0 nodes is recorded, not enacted). One
decision is enacted at a time: a trigger that arrives meanwhile is re-solved once every count
reached its target (`settled`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from oobleck_hpc.errors import EXIT_REQUEUE
from oobleck_hpc.fleet.allocate import JobCurve, decide


@dataclass(frozen=True)
class Drain:
    job: str
    node: str
    for_job: str


@dataclass(frozen=True)
class Grow:
    job: str
    count: int
    from_job: str


@dataclass(frozen=True)
class Start:
    job: str
    count: int
    attempt: int = 0
    """0: its first start; k: its k-th requeue in the fleet (from its checkpoint)."""


@dataclass(frozen=True)
class Stop:
    """Stop the job at its next step boundary with a checkpoint (SIGTERM to its launcher: it
    exits 75), to be requeued inside the fleet."""

    job: str


Action = Drain | Grow | Start | Stop


@dataclass
class JobState:
    """One job as the manager knows it from its events."""

    name: str
    waf: np.ndarray
    """WAF on n nodes (curves.py), n = 0..pool."""
    min_nodes: int = 1
    max_nodes: int | None = None
    transition_s: float = 0.0
    started: int = 0
    """Nodes it started with (0: not started); a grown node joins only below it."""
    count: int = 0
    """Nodes its plan runs on now (its latest `plan_chosen`)."""
    members: list[str] = field(default_factory=list)
    state: str = "waiting"
    """waiting | running | finished | failed"""
    attempts: int = 0
    """Times it fell back to its checkpoint and was requeued in the fleet."""
    stopping: bool = False
    """Asked to stop at its checkpoint (below min_nodes): not asked again."""
    target: int | None = None
    """The count the decision being enacted gives it."""
    growing: int = 0
    """Nodes asked for (grow) that its plan does not run on yet."""
    pauses: list[float] = field(default_factory=list)
    """Its measured pauses (`recovered` events' seconds), in order."""

    DYNAMIC = ("started", "count", "members", "state", "target", "growing", "pauses",
               "attempts", "stopping")
    """The fields the events change (the rest comes from the fleet file): `snapshot`."""

    @property
    def running(self) -> bool:
        return self.state == "running"

    def pause_s(self) -> float:
        """Its pause when its count changes: the median of the measured ones, else the fleet
        file's transition_s."""
        if not self.pauses:
            return self.transition_s
        ordered = sorted(self.pauses)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def curve(self) -> JobCurve:
        if self.state in ("finished", "failed"):
            return JobCurve(self.name, self.waf, max_nodes=0)
        smallest = int(np.flatnonzero(self.waf > 0)[0]) if (self.waf > 0).any() else 1
        cap = self.max_nodes
        if self.running:  # a local grown node joins only below the count it started with
            cap = self.started if cap is None else min(cap, self.started)
        return JobCurve(self.name, self.waf, max(self.min_nodes, smallest), cap,
                        self.pause_s(), self.count if self.running else None)


class Manager:
    """The manager's state: each job, the free nodes, the moves under way (module docstring)."""

    def __init__(self, jobs: list[JobState], pool: int, horizon_s: float,
                 emit: Callable[..., Any]):
        self.jobs = {j.name: j for j in jobs}
        self.free = pool
        self.horizon_s = horizon_s
        self.emit = emit
        self.draining: dict[str, tuple[str, str]] = {}
        """node asked to drain -> (its job, the job it goes to)."""
        self.again: list[tuple[str, str]] = []
        """(trigger, reason) that came while a decision was enacted."""

    def snapshot(self) -> dict[str, Any]:
        """The state the events made (module docstring), as JSON-ready data."""
        return {"free": self.free, "again": [list(a) for a in self.again],
                "draining": {node: list(v) for node, v in self.draining.items()},
                "jobs": {n: {k: getattr(j, k) for k in JobState.DYNAMIC}
                         for n, j in self.jobs.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Take back a `snapshot()` (of a manager of the same fleet)."""
        if set(snap["jobs"]) != set(self.jobs):
            raise ValueError(f"the snapshot's jobs {sorted(snap['jobs'])} are not the "
                             f"fleet's {sorted(self.jobs)}")
        self.free = int(snap["free"])
        self.again = [(str(t), str(r)) for t, r in snap["again"]]
        self.draining = {node: (str(a), str(b)) for node, (a, b) in snap["draining"].items()}
        for name, fields in snap["jobs"].items():
            for k in JobState.DYNAMIC:
                setattr(self.jobs[name], k, fields[k])

    def waf_now(self) -> float:
        return sum(float(j.waf[j.count]) for j in self.jobs.values() if j.running)

    def counts(self) -> dict[str, int]:
        return {n: j.count if j.running else 0 for n, j in self.jobs.items()}

    def start(self) -> list[Action]:
        """The first allocation: a fresh decision on the pool (nothing moves)."""
        decision = decide([j.curve() for j in self.jobs.values()], self.free)
        after = dict(zip(self.jobs, decision.nodes))
        self.emit("fleet_decision", trigger="", reason=f"the first allocation of the pool's "
                  f"{self.free} nodes (nothing runs: no move costs)",
                  nodes_before=dict.fromkeys(self.jobs, 0), nodes_after=after, waf_before=0.0,
                  waf_after=decision.total_waf, objective=decision.objective,
                  free=self.free, enacted=True, moves=[[n, 0, k] for n, k in after.items() if k])
        out: list[Action] = []
        for job, k in zip(self.jobs.values(), decision.nodes):
            if k > 0:
                out.append(self._start(job, k))
        return out

    def _start(self, job: JobState, k: int) -> Start:
        job.state, job.started, job.count, job.target, job.growing = "running", k, k, None, 0
        job.members = [f"node{i}" for i in range(k)]  # (a local job's; a Slurm one's: run_started)
        self.free -= k
        return Start(job.name, k, job.attempts)

    def on_event(self, name: str, e: dict[str, Any]) -> list[Action]:
        """One event of job `name`'s events file."""
        job, kind = self.jobs[name], e.get("kind")
        if kind == "membership_agreed" or (kind == "run_started" and e.get("on_nodes")):
            job.members = list(e["nodes"] if kind == "membership_agreed" else e["on_nodes"])
        elif kind == "plan_chosen" and e["nodes"] != job.count and job.running:
            job.growing = max(0, job.growing - max(0, int(e["nodes"]) - job.count))
            job.count = int(e["nodes"])
            if job.count == job.target:
                job.target = None
            self.emit("fleet_nodes", job=name, nodes=job.count, counts=self.counts(),
                      waf=self.waf_now())
            if job.count < job.min_nodes and not job.stopping:
                job.stopping = True
                self.emit("fleet_stop", job=name, nodes=job.count, reason=f"{name} runs on "
                          f"{job.count} nodes, below its min_nodes {job.min_nodes}: stopped at "
                          "its checkpoint, it waits for nodes")
                return [Stop(name)]
        elif kind == "recovered":
            job.pauses.append(float(e["seconds"]))
            if lost := sorted(set(e["lost"]) - set(e["drained"])):
                job.target = None  # (a loss changed its count: a target it had is void)
                return self.trigger(name, f"{', '.join(lost)} lost in {name}; it recovered "
                                    f"in place (step {e['step']} committed)")
        elif kind == "fallback" and e.get("nodes") and job.running:
            job.count = min(job.count, len(set(e["nodes"])))  # (the survivors: freed at its exit)
        elif kind == "drain_agreed":
            return self._drained(name, [n for n in e["nodes"] if n in self.draining])
        elif kind == "drain_refused":
            for node in [n for n in e["nodes"] if n in self.draining]:
                _, to = self.draining.pop(node)
                for stays in (job, self.jobs.get(to)):
                    if stays is not None:
                        stays.target = None
                self.emit("fleet_move_failed", job=name, reason=f"drain of {node} refused: "
                          f"{e.get('reason', '')}")
        return self._retry()

    def on_exit(self, name: str, code: int, finished: bool) -> list[Action]:
        """Job `name`'s launcher exited: its nodes are free; exit 75 (EXIT_REQUEUE: it fell
        back to its checkpoint) and it waits to be started again (module docstring)."""
        job = self.jobs[name]
        nodes = job.count if job.running else 0
        requeued = code == EXIT_REQUEUE and not finished
        job.state = "waiting" if requeued else "finished" if finished else "failed"
        job.attempts += requeued
        job.stopping = False
        job.target = None
        self.free += nodes
        for node, (src, to) in list(self.draining.items()):
            if name in (src, to):  # a move that cannot complete any more
                del self.draining[node]
                for other in (self.jobs[src], self.jobs.get(to)):
                    if other is not None:
                        other.target = None
        self.emit("fleet_job_ended", job=name, code=code, finished=finished, nodes=nodes,
                  requeued=requeued)
        self.emit("fleet_nodes", job=name, nodes=0, counts=self.counts(), waf=self.waf_now())
        if not any(j.running for j in self.jobs.values()):
            return self._start_waiting()
        how = ("fell back to its checkpoint: it waits for nodes" if requeued else
               "ended (finished)" if finished else f"ended (exit {code})")
        return self.trigger(name, f"{name} {how}; its {nodes} nodes are free")

    def settled(self) -> bool:
        """No move under way: no drain unanswered, no grown node not yet in its job's plan,
        every job the last decision changed at its count, no job stopping."""
        return not self.draining and all(
            j.growing == 0 and (j.target is None or j.count == j.target) and not j.stopping
            for j in self.jobs.values() if j.running)

    def _retry(self) -> list[Action]:
        if self.again and self.settled():
            trigger, reason = self.again.pop(0)
            return self.trigger(trigger, reason)
        return []

    def _start_waiting(self) -> list[Action]:
        return self.trigger("", "no job runs: the waiting jobs start") \
            if any(j.state == "waiting" for j in self.jobs.values()) else []

    def trigger(self, name: str, reason: str) -> list[Action]:
        """Re-solve and enact (module docstring)."""
        if not self.settled():
            self.again.append((name, reason))
            return []
        jobs = list(self.jobs.values())
        before = self.counts()
        total = sum(before.values()) + self.free
        decision = decide([j.curve() for j in jobs], total, self.horizon_s)
        after = dict(zip(self.jobs, decision.nodes))
        stops = [j.name for j in jobs if j.running and after[j.name] == 0]
        enact = not stops
        why = reason + (f"; not enacted: it would stop {', '.join(stops)} (the fleet "
                        "stops no running job)" if stops else "")
        moves = [[n, before[n], after[n]] for n in after if before[n] != after[n]]
        self.emit("fleet_decision", trigger=name, reason=why, nodes_before=before,
                  nodes_after=after, waf_before=self.waf_now(), waf_after=decision.total_waf,
                  objective=decision.objective if math.isfinite(decision.objective) else 0.0,
                  free=self.free, enacted=enact, moves=moves,
                  pause_s={j.name: round(j.pause_s(), 3) for j in jobs})
        if not enact or not moves:
            return []
        return self._enact(jobs, after)

    def _enact(self, jobs: list[JobState], after: dict[str, int]) -> list[Action]:
        out: list[Action] = []
        takers = [j for j in jobs if j.running and after[j.name] > j.count]
        for job in jobs:  # (a waiting job runs on nothing, whatever count it had)
            now = job.count if job.running else 0
            job.target = after[job.name] if after[job.name] != now else None
            if job.state == "waiting" and after[job.name] > 0:
                takers.append(job)
        givers = [j for j in jobs if j.running and after[j.name] < j.count]
        wants = [(t, after[t.name] - (t.count if t.running else 0)) for t in takers]
        queue = [t.name for t, k in wants for _ in range(k)]
        for job in givers:  # its last members leave, each for the next taker in line
            leaving = job.count - after[job.name]
            for node in job.members[len(job.members) - leaving:]:
                to = queue.pop(0) if queue else ""
                self.draining[node] = (job.name, to)
                self.emit("fleet_drain", job=job.name, node=node, for_job=to)
                out.append(Drain(job.name, node, to))
        return out + self._give("")

    def _drained(self, name: str, nodes: list[str]) -> list[Action]:
        """`nodes` left job `name` (drain_agreed): free, then given to their takers."""
        givers: dict[str, str] = {}
        for node in nodes:
            _, to = self.draining.pop(node)
            self.free += 1
            givers[to] = name
        out: list[Action] = []
        for to, src in givers.items():
            out += self._give(src, only=to)
        return out

    def _give(self, src: str, only: str | None = None) -> list[Action]:
        """Free nodes to the jobs below their target (waiting ones start), while nodes are free
        and not promised to a drain under way."""
        out: list[Action] = []
        promised = {to for _, to in self.draining.values()}
        for job in self.jobs.values():
            if job.target is None or (only is not None and job.name != only):
                continue
            if job.state == "waiting" and self.free >= job.target and job.name not in promised:
                out.append(self._start(job, job.target))
                self.emit("fleet_nodes", job=job.name, nodes=job.count, counts=self.counts(),
                          waf=self.waf_now())
            elif job.running and job.name not in promised:
                k = min(job.target - job.count - job.growing, self.free)
                if k > 0:
                    self.free -= k
                    job.growing += k
                    out.append(Grow(job.name, k, src))
        return out
