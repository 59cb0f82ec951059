"""Failure traces: when which node dies (and, optionally, when a node joins).

A `Trace` is the initial node list plus a time-ordered tuple of `TraceEvent(time_s, kind, node)`
with kind "fail" or "add". Every policy of the simulator replays the same trace, so policies are
compared on identical failures.

Sources:

- `fixed_interval(nodes, every_s, duration_s, seed)`: one failure every `every_s` seconds
  (the paper's "one failure every 10 minutes"); the victim is drawn uniformly from the nodes
  still alive (seeded). `replace_after_s` as below.
- `exponential(nodes, mtbf_s, duration_s, seed, per="node"|"cluster")`: memoryless failures.
  `per="node"`: each node fails after an Exp(1/mtbf) lifetime, so the cluster's failure rate is
  alive/mtbf and falls as nodes die; `per="cluster"`: the cluster as a whole fails at rate
  1/mtbf (inter-arrival Exp(mtbf)), the victim drawn uniformly from the alive nodes.
  `replace_after_s` (optional) brings a fresh node back that long after each failure
  (a repaired or replacement node), so a long run need not shrink.
- `bursts(nodes, mtbf_s, size, duration_s, seed)`: correlated failures: `size` neighbouring
  nodes (a rack, a switch) fail together, bursts at exponential intervals of mean `mtbf_s`;
  `replace_after_s` as above.
- `load_trace(path)`: replay a cluster log. CSV with a header row `time,event,node`
  (or `time_ms,...` for milliseconds), or headerless rows `time,event,node` as in the Oobleck
  artifact's traces (time in milliseconds there: pass `time_unit="ms"`), or JSONL with one
  `{"time": 12.5, "event": "fail", "node": "n7"}` object per line. Events: `fail` (alias
  `remove`) and `add`. `add` events at time 0 define the initial nodes; when there are none,
  the caller's node list is the initial cluster.

Random draws use `random.Random(seed)` only, so a trace is a pure function of its arguments.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from oobleck_hpc.errors import ConfigError

EventKind = Literal["fail", "add"]


@dataclass(frozen=True, order=True)
class TraceEvent:
    time_s: float
    kind: EventKind
    node: str


@dataclass(frozen=True)
class Trace:
    nodes: tuple[str, ...]
    """Nodes alive at time 0, in the job's node order."""
    events: tuple[TraceEvent, ...]
    """Sorted by time; ties keep file order."""
    description: str = ""

    @property
    def failures(self) -> int:
        return sum(1 for e in self.events if e.kind == "fail")

    def until(self, duration_s: float) -> Trace:
        """The events strictly before `duration_s`."""
        return Trace(self.nodes, tuple(e for e in self.events if e.time_s < duration_s),
                     self.description)

    def with_arrivals(self, delay_s: float, count: int | None = None,
                      description: str = "") -> Trace:
        """This trace with a fresh node joining `delay_s` after each of its first `count`
        failures (all when None): spares swapped in by the loss's own round (`delay_s`: its
        detection), or replacement nodes that take that long to arrive. The failures are the
        same, so the variants compare on identical losses."""
        fails = [e for e in self.events if e.kind == "fail"]
        fails = fails if count is None else fails[:count]
        adds = [TraceEvent(e.time_s + delay_s, "add", f"new{k}") for k, e in enumerate(fails, 1)]
        events = sorted(self.events + tuple(adds), key=lambda e: e.time_s)
        return Trace(self.nodes, tuple(events), description or self.description)

    def mean_failure_interval_s(self, duration_s: float) -> float:
        """Observed mean time between failures of the whole job over `duration_s` (inf if none)."""
        n = sum(1 for e in self.events if e.kind == "fail" and e.time_s < duration_s)
        return duration_s / n if n else math.inf


def node_names(count: int) -> tuple[str, ...]:
    width = len(str(max(count - 1, 0)))
    return tuple(f"node{i:0{width}d}" for i in range(count))


def fixed_interval(nodes: tuple[str, ...], every_s: float, duration_s: float,
                   seed: int = 0, replace_after_s: float | None = None) -> Trace:
    """A failure at every_s, 2*every_s, ... (< duration_s), victims drawn from alive nodes;
    with `replace_after_s`, a fresh node joins that long after each failure."""
    if every_s <= 0:
        raise ValueError(f"failure interval must be positive, got {every_s} s")
    rng = random.Random(seed)
    alive = list(nodes)
    events = []
    pending: list[tuple[float, str]] = []
    k = 1
    while k * every_s < duration_s:
        t = k * every_s
        while pending and pending[0][0] <= t:
            ta, name = heapq.heappop(pending)
            events.append(TraceEvent(ta, "add", name))
            alive.append(name)
        if alive:
            victim = alive.pop(rng.randrange(len(alive)))
            events.append(TraceEvent(t, "fail", victim))
            if replace_after_s is not None:
                heapq.heappush(pending, (t + replace_after_s, f"spare{k}"))
        k += 1
    events += [TraceEvent(ta, "add", name) for ta, name in sorted(pending) if ta < duration_s]
    events.sort(key=lambda e: e.time_s)
    desc = f"one failure every {every_s / 60:g} min"
    if replace_after_s is not None:
        desc += f", replaced after {replace_after_s / 60:g} min"
    return Trace(tuple(nodes), tuple(events), desc)


def exponential(nodes: tuple[str, ...], mtbf_s: float, duration_s: float, seed: int = 0,
                per: Literal["node", "cluster"] = "cluster",
                replace_after_s: float | None = None) -> Trace:
    """Memoryless failures; see the module docstring for `per` and `replace_after_s`."""
    if mtbf_s <= 0:
        raise ValueError(f"MTBF must be positive, got {mtbf_s} s")
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    fresh = 0

    def new_name() -> str:
        nonlocal fresh
        fresh += 1
        return f"spare{fresh}"

    if per == "node":
        # One pending death per alive node; a replacement draws its own lifetime.
        heap = [(rng.expovariate(1.0 / mtbf_s), i, n) for i, n in enumerate(nodes)]
        heapq.heapify(heap)
        arrivals: list[tuple[float, str]] = []
        order = len(nodes)
        while heap or arrivals:
            t_fail = heap[0][0] if heap else math.inf
            t_add = arrivals[0][0] if arrivals else math.inf
            if min(t_fail, t_add) >= duration_s:
                break
            if t_add < t_fail:
                t, name = heapq.heappop(arrivals)
                events.append(TraceEvent(t, "add", name))
                order += 1
                heapq.heappush(heap, (t + rng.expovariate(1.0 / mtbf_s), order, name))
                continue
            t, _, name = heapq.heappop(heap)
            events.append(TraceEvent(t, "fail", name))
            if replace_after_s is not None:
                heapq.heappush(arrivals, (t + replace_after_s, new_name()))
        desc = f"exponential, MTBF {mtbf_s / 3600:g} h per node"
    else:
        alive = list(nodes)
        pending: list[tuple[float, str]] = []
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf_s)
            # Replacements that arrived before this failure rejoin first.
            while pending and pending[0][0] <= min(t, duration_s):
                ta, name = heapq.heappop(pending)
                if ta < duration_s:
                    events.append(TraceEvent(ta, "add", name))
                    alive.append(name)
            if t >= duration_s:
                break
            if not alive:
                continue
            victim = alive.pop(rng.randrange(len(alive)))
            events.append(TraceEvent(t, "fail", victim))
            if replace_after_s is not None:
                heapq.heappush(pending, (t + replace_after_s, new_name()))
        desc = f"exponential, MTBF {mtbf_s / 3600:g} h for the cluster"
    if replace_after_s is not None:
        desc += f", replaced after {replace_after_s / 60:g} min"
    events.sort(key=lambda e: e.time_s)
    return Trace(tuple(nodes), tuple(events), desc)


def bursts(nodes: tuple[str, ...], mtbf_s: float, size: int, duration_s: float, seed: int = 0,
           replace_after_s: float | None = None) -> Trace:
    """Correlated failures: at exponential intervals (mean `mtbf_s`) `size` nodes that share a
    rack or a switch -- neighbours in the node list among those alive -- fail at the same
    instant; with `replace_after_s`, each comes back (a fresh node) that long after."""
    if mtbf_s <= 0 or size < 1:
        raise ValueError(f"burst MTBF must be positive and size >= 1, got {mtbf_s} s, {size}")
    rng = random.Random(seed)
    alive = list(nodes)
    events: list[TraceEvent] = []
    pending: list[tuple[float, str]] = []
    t, fresh = 0.0, 0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        while pending and pending[0][0] <= min(t, duration_s):
            ta, name = heapq.heappop(pending)
            events.append(TraceEvent(ta, "add", name))
            alive.append(name)
        if t >= duration_s:
            break
        first = rng.randrange(len(alive)) if alive else 0
        for victim in alive[first:first + size]:
            events.append(TraceEvent(t, "fail", victim))
            if replace_after_s is not None:
                fresh += 1
                heapq.heappush(pending, (t + replace_after_s, f"spare{fresh}"))
        del alive[first:first + size]
    desc = f"bursts of {size} nodes, MTBF {mtbf_s / 3600:g} h"
    if replace_after_s is not None:
        desc += f", replaced after {replace_after_s / 60:g} min"
    events.sort(key=lambda e: e.time_s)
    return Trace(tuple(nodes), tuple(events), desc)


_EVENT_ALIASES = {"fail": "fail", "failure": "fail", "remove": "fail", "add": "add", "join": "add"}


def load_trace(path: str | Path, nodes: tuple[str, ...] = (),
               time_unit: Literal["s", "ms"] = "s") -> Trace:
    """Read a CSV or JSONL trace (see the module docstring). `nodes` is the initial cluster when
    the file has no `add` events at time 0."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(str(path), "<file>", f"cannot be read ({e.strerror})",
                          "pass the path of an existing CSV or JSONL trace") from e
    rows: list[tuple[int, str, str, str]] = []  # (line, time text, event, node)
    scale = 1.0 if time_unit == "s" else 1e-3
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if first.lstrip().startswith("{"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(str(path), f"line {i}", f"is not valid JSON ({e.msg})",
                                  'write one {"time": s, "event": "fail", "node": "n1"} per line')
            if not isinstance(obj, dict) or not {"event", "node"} <= set(obj) or not (
                    "time" in obj or "time_ms" in obj):
                raise ConfigError(str(path), f"line {i}", f"value {line.strip()!r} lacks "
                                  "time, event or node", 'write {"time": s, "event": "fail", '
                                  '"node": "n1"}')
            t = obj["time"] if "time" in obj else obj["time_ms"] / 1000.0 / scale
            rows.append((i, str(t), str(obj["event"]), str(obj["node"])))
    else:
        reader = list(csv.reader(lines))
        start = 0
        header = [c.strip().lower() for c in reader[0]] if reader else []
        if header and header[0] in ("time", "time_s", "time_ms"):
            if header[:3] not in (["time", "event", "node"], ["time_s", "event", "node"],
                                  ["time_ms", "event", "node"]):
                raise ConfigError(str(path), "line 1", f"value {reader[0]!r} is not a known header",
                                  "use 'time,event,node' (seconds) or 'time_ms,event,node'")
            if header[0] == "time_ms":
                scale = 1e-3
            start = 1
        for i, row in enumerate(reader[start:], start + 1):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3:
                raise ConfigError(str(path), f"line {i}", f"value {row!r} has {len(row)} columns",
                                  "write 'time,event,node' on every line")
            rows.append((i, row[0].strip(), row[1].strip(), row[2].strip()))
    initial: list[str] = []
    events: list[TraceEvent] = []
    for i, t_text, event, node in rows:
        try:
            t = float(t_text) * scale
        except ValueError:
            raise ConfigError(str(path), f"line {i}", f"time {t_text!r} is not a number",
                              "write the time in seconds (or use a time_ms header)") from None
        if not math.isfinite(t) or t < 0:
            raise ConfigError(str(path), f"line {i}", f"time {t_text!r} is negative or not finite",
                              "times are seconds since the job started, >= 0")
        kind = _EVENT_ALIASES.get(event.lower())
        if kind is None:
            raise ConfigError(str(path), f"line {i}", f"event {event!r} is not known",
                              f"use one of: {', '.join(_EVENT_ALIASES)}")
        if not node:
            raise ConfigError(str(path), f"line {i}", "has an empty node name", "name the node")
        if kind == "add" and t == 0:
            initial.append(node)
        else:
            events.append(TraceEvent(t, kind, node))  # type: ignore[arg-type]
    events.sort(key=lambda e: e.time_s)  # stable: ties keep file order
    start_nodes = tuple(initial) if initial else tuple(nodes)
    if not start_nodes:
        raise ConfigError(str(path), "<file>", "defines no initial nodes (no 'add' at time 0)",
                          "add '0,add,<node>' lines or give the job's node count")
    return Trace(start_nodes, tuple(events), f"replay of {path.name}")
