"""The run's event log: one JSON object per line in `<run_dir>/events.jsonl`, plus a short human line.

Every transition of a job (failure detected, agreement reached, plan chosen, groups rebuilt, bytes
transferred, first step committed after recovery, ...) is one event:

    log = EventLog(run_dir / "events.jsonl", source="node3")
    log.emit(FAILURE_DETECTED, node="node1", how="connection_lost", gen=4)

writes

    {"t": 1763788000.123456, "kind": "failure_detected", "source": "node3", "run": "20261125-041502-9f3a",
     "attempt": 0, "node": "node1", ...}

and logs `[node3] failure_detected node=node1 how=connection_lost gen=4` to the
`oobleck_hpc.events` logger. `t` is wall-clock Unix time (time.time()): events of different
processes on one machine (or on nodes with synchronised clocks) can be merged and subtracted. `run`
and `attempt` name the run and the attempt (requeue) that wrote the event (oobleck_hpc/records/runs.py);
steps are numbered from 1, as in the metrics file and on the console (`step` k = the k-th
training step).

Concurrency: every event is one `os.write` of one line to a file opened with O_APPEND, so the
lines of many processes on one machine never interleave (the kernel serialises appends on local
file systems). On NFS, O_APPEND is not atomic across hosts: give each node its own file there
(e.g. `events.<node>.jsonl`) and merge them with `read_events`, which accepts a glob.

Every kind is declared below (`KINDS`: its meaning, its fields and their types), and `emit`
refuses an undeclared kind or field, so that a reader (story, report, chaos, progress, benches),
which names kinds by these constants, cannot drift from the writers.

The log never raises into the caller for I/O: an event that cannot be written (disk full, directory
removed) is reported once on the logger and dropped -- training does not stop for a log line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck_hpc.records import runs
from oobleck_hpc.records.runs import read_jsonl  # (re-exported: the readers import it from here)

logger = logging.getLogger("oobleck_hpc.events")


@dataclass(frozen=True)
class Kind:
    """One declared event kind: what it means, its fields (name -> type; always written) and its
    optional fields (written by some of its writers only). `EventLog.emit` checks the names."""

    name: str
    doc: str
    fields: dict[str, Any]
    optional: dict[str, Any] = field(default_factory=dict)


KINDS: dict[str, Kind] = {}
"""Every event kind of the package, by name (the constants below are their names)."""


def _declare(name: str, doc: str, fields: dict[str, Any],
             optional: dict[str, Any] | None = None) -> str:
    KINDS[name] = Kind(name, doc, fields, optional or {})
    return name


_Nodes = list[str]
_Opt = float | None

# The run (launcher, driver of a Slurm job, grow, kill-node, requeue).
RUN_STARTED = _declare("run_started", "The launcher started the run (or a Slurm job's driver did).",
                       {"launch": str, "nodes": int},
                       {"job": str, "model": str, "steps": int, "gpus_per_node": int,
                        "job_id": str, "pid": int, "on_nodes": _Nodes})
RUN_FINISHED = _declare("run_finished", "Training reached its last step (rank 0 of the plan).",
                        {"steps": int, "total": int, "model": str},
                        {"wall_s": float, "first_loss": _Opt, "last_loss": _Opt,
                         "samples_per_s": _Opt, "plan": str, "nodes": int, "recoveries": int})
RUN_ENDED = _declare("run_ended", "The launcher saw the run end: its verdict and exit code.",
                     {"code": int, "reason": str, "finished": bool, "outcome": str,
                      "last_step": int, "total": int})
REQUEUED = _declare("requeued", "The run is started again from its checkpoint (a requeue).",
                    {"next_attempt": int, "nodes": Any, "alive": Any, "reason": str},
                    {"seconds": float})
NODES_ADDED = _declare("nodes_added", "Nodes were started and asked to join (grow).",
                       {"nodes": _Nodes, "how": str, "pids": dict})
NODE_KILLED = _declare("node_killed", "kill-node signalled a node's agent.",
                       {"node": str, "signal": str, "pid": int})
REQUEST_IGNORED = _declare("request_ignored", "A grow or drain request file was not acted on.",
                           {"request": str, "path": str, "reason": str})
REPLACEMENT_SUBMITTED = _declare("replacement_submitted",
                                 "A Slurm job was submitted to replace lost nodes.",
                                 {"job_id": str, "nodes": int, "for_job": str, "reason": str})
REPLACEMENTS_ENDED = _declare("replacements_ended", "The replacement jobs were cancelled or ended.",
                              {"job_ids": list, "why": str})
NODES_RELEASED = _declare("nodes_released", "Nodes drained from a Slurm job were given back.",
                          {"nodes": _Nodes, "ok": bool, "detail": str})
# The agents (per-node supervisor) and the control plane.
AGENT_STARTED = _declare("agent_started", "A node's agent started its workers.",
                         {"pid": int, "workers": int, "port": int, "worker_pids": list},
                         {"realtime": bool})
AGENT_EXIT = _declare("agent_exit", "A node's agent exits with this code.",
                      {"code": int, "reason": str}, {"how": str})
AGENT_FINISHED = _declare("agent_finished", "Every worker of the node finished.",
                          {"codes": list, "how": str})
SIGNAL = _declare("signal", "The agent received a signal.", {"signal": str})
WORKER_REPORT = _declare("worker_report", "A worker reported an error to its agent.",
                         {"local_rank": int, "what": str, "detail": str, "suspects": list})
WORKER_EXITED = _declare("worker_exited", "A worker process exited (its agent's view).",
                         {"local_rank": int, "code": int},
                         {"drained": bool, "reason": str, "leaving": bool, "done": bool,
                          "pid": int, "stopped": bool})
WORKER_RESTARTING = _declare("worker_restarting",
                             "A worker crashed: its node steps out, its workers restart.",
                             {"local_rank": int, "code": int, "detail": str, "crashes": int,
                              "restarts": int, "after_gen": int, "pid": int})
WORKER_STOPPED = _declare("worker_stopped",
                          "A peer waited on this node and its worker was stopped: killed (a crash).",
                          {"local_rank": int, "pid": int, "pinged_by": str})
WORKER_FAILED = _declare("worker_failed", "A worker crashed too often: its node leaves.",
                         {"local_rank": int, "code": int, "detail": str, "crashes": int})
DRAIN_REQUESTED = _declare("drain_requested", "A node was asked to leave (drain).",
                           {"node": str, "force": bool, "by": str})
NODE_SLOWED = _declare("node_slowed", "The slow fault slowed a node down.",
                       {"node": str, "factor": float})
NODE_DRAINED = _declare("node_drained", "A drained node's workers left the job.", {"node": str})
DRAINED_OUT = _declare("drained_out",
                      "A node that a commit vote drained is out: its peers decided without it "
                      "(or it said BYE to a round that still held it).",
                      {"node": str, "gen": int, "how": str})
FAILURE_DETECTED = _declare("failure_detected",
                            "An agent suspects a peer (lease, connection, probe).",
                            {"node": str, "how": str, "gen": int})
ROUND_STARTED = _declare("round_started", "A membership round opened.",
                         {"gen": int, "suspects": _Nodes, "joiners": _Nodes})
AGREEMENT_REACHED = _declare("agreement_reached", "The agents decided a new membership.",
                             {"gen": int, "nodes": _Nodes, "lost": _Nodes, "joined": _Nodes,
                              "store_node": str, "store_addr": str, "how": str, "round_s": _Opt})
FENCED = _declare("fenced", "A node found itself outside the membership and stops.",
                  {"reason": str, "gen": int, "code": int})
JOIN_REQUESTED = _declare("join_requested", "This node asked the members to let it join.",
                          {"node": str, "gen": int, "how": str})
JOIN_REQUEST = _declare("join_request", "A member received a node's request to join.",
                        {"node": str, "gen": int, "how": str})
PEER_LEFT = _declare("peer_left", "A peer announced that it leaves (with its exit code).",
                     {"node": str, "code": int})
RETRY_ROUND = _declare("retry_round", "A round is retried (a new generation).",
                       {"gen": int, "why": str})
EXCHANGE_FAILED = _declare("exchange_failed", "A value exchange between the workers failed.",
                           {"key": str, "gen": int, "reason": str})
PROBE = _declare("probe", "A worker's communication error made the agent probe its peers.",
                 {"why": str, "timeout_s": float})
STALL_PROBED = _declare("stall_probed",
                        "A worker's stall made its agent ping the nodes it waits on (and "
                        "witnesses): a lone silent one is suspected if another node answered "
                        "(else unconfirmed; answered_s: node -> seconds to its answer).",
                        {"why": str, "nodes": _Nodes, "silent": _Nodes, "witnesses": _Nodes,
                         "unconfirmed": bool, "timeout_s": float, "answered_s": dict})
PROBE_SKIPPED = _declare("probe_skipped", "A probe was not started (a round answers already).",
                         {"why": str, "failed_gen": int, "gen": int, "round_open": bool})
CONNECTION_REOPENED = _declare("connection_reopened", "A link to a peer was opened again.",
                               {"node": str})
FRAME_REJECTED = _declare("frame_rejected", "A control-plane frame failed its checks.",
                          {"node": str, "peer": str, "reason": str, "count": int})
CONTROL_LOOP_DIED = _declare("control_loop_died",
                             "The control loop raised (a bug): the node stops.",
                             {"error": str})
PEER_ADDED = _declare("peer_added", "A new peer's address became known.",
                      {"node": str, "addr": str})
START_LEASE_ENDED = _declare("start_lease_ended",
                              "The node's workers are past their start: its leases are lease_s "
                              "from now on, not the start's longer one.", {"lease_s": float})
SILENCE_REPORTED = _declare("silence_reported", "Observers reported a silent subject.",
                            {"node": str, "how": str, "observers": _Nodes})
# The workers (training and recovery).
FAULT_INJECTED = _declare("fault_injected", "An injected fault fires (control/faults.py).",
                          {"node": str, "local_rank": int, "step": int, "phase": str,
                           "fault": str})
STEP_FAILED = _declare("step_failed", "A training step failed on a communication error.",
                       {"step": int, "phase": str, "peer": Any, "suspects": list, "error": str,
                        "generation": int})
MEMBERSHIP_AGREED = _declare("membership_agreed", "The workers took the agents' new membership.",
                             {"generation": int, "nodes": _Nodes, "lost": _Nodes,
                              "joined": _Nodes, "store": str})
PLAN_CHOSEN = _declare("plan_chosen", "The plan of a generation (pipelines, microbatches).",
                       {"generation": int, "plan": str, "pipelines": list, "microbatches": list,
                        "nodes": int, "gpus_per_node": int, "predicted_step_ms": float,
                        "note": str, "layout": Any},
                       {"lost": _Nodes, "joined": _Nodes, "start": bool,
                        "plan_seconds": float})
GROUPS_REBUILT = _declare("groups_rebuilt", "The process groups of a generation were built.",
                          {"generation": int, "world": int, "groups": int, "seconds": float})
STATE_TRANSFERRED = _declare("state_transferred", "A rank sent and received its layers' state.",
                             {"generation": int, "rank": int, "sent_bytes": int,
                              "received_bytes": int, "layers_in": Any, "layers_out": Any,
                              "seconds": float, "init_seconds": float})
RECONFIGURATION_FAILED = _declare("reconfiguration_failed", "A recovery round failed.",
                                  {"generation": int, "error": str})
RENDEZVOUS_FAILED = _declare("rendezvous_failed", "A worker's rendezvous failed.",
                             {"generation": int, "error": str})
ROLLED_FORWARD = _declare("rolled_forward", "A step committed on a plan is kept (not replayed).",
                          {"step": int, "generation": int, "plan": str})
RECOVERED = _declare("recovered", "The first step after a recovery committed.",
                     {"step": int, "generation": int, "lost": _Nodes, "joined": _Nodes,
                      "drained": _Nodes, "seconds": float, "rounds": int, "plan": str,
                      "phases": dict, "bytes_moved": int})
_JOINED = {"node": str, "generation": int, "step": int, "seconds": float, "phases": dict,
           "received_bytes": int}
NODE_JOINED = _declare("node_joined", "A new node's first step committed.", _JOINED)
WORKER_REJOINED = _declare("worker_rejoined", "A restarted worker's first step committed.", _JOINED)
_DRAIN = {"nodes": _Nodes, "step": int, "force": bool, "reason": str, "plan": Any}
DRAIN_AGREED = _declare("drain_agreed", "The workers agreed to let nodes leave at a step.", _DRAIN)
DRAIN_REFUSED = _declare("drain_refused", "A drain was refused (no plan without the nodes).",
                         _DRAIN)
STRAGGLER = _declare("straggler", "A slow node was found and acted on (keep, replan, drain).",
                     {"node": str, "slowdown": float, "action": str, "predicted_ms": float,
                      "step": int, "plan": Any})
STRAGGLER_MEASURED = _declare("straggler_measured",
                              "Step time before and after a straggler action.",
                              {"node": str, "action": str, "predicted_ms": float,
                               "before_s": float, "after_s": float})
RESTORED = _declare("restored", "Training state was loaded from a checkpoint.",
                    {"step": int, "path": str, "seconds": float, "plan": str, "written_by": Any})
CHECKPOINT_SAVED = _declare("checkpoint_saved", "A checkpoint was written.",
                            {"step": int, "bytes": int, "seconds": float, "path": str})
STOPPING = _declare("stopping", "Training stops at a step (a signal, a requeue).",
                    {"step": int, "reason": str})
FALLBACK = _declare("fallback", "No in-place recovery: the job restarts from its checkpoint.",
                    {"reason": str, "nodes": _Nodes, "resume_from": Any})

# The fleet manager (`oobleck-hpc fleet run`: launch/fleet.py, fleet/manager.py): the fleet's own
# RUN_DIR/events.jsonl. Node counts are by job name; WAF in weighted FLOP/s.
_Counts = dict
FLEET_STARTED = _declare("fleet_started", "The fleet manager started its jobs on the pool.",
                         {"fleet": str, "pool": int, "nodes": _Counts, "waf": float,
                          "run_dirs": dict})
FLEET_DECISION = _declare("fleet_decision",
                          "The manager re-solved the allocation (allocate.decide) and why.",
                          {"trigger": str, "reason": str, "nodes_before": _Counts,
                           "nodes_after": _Counts, "waf_before": float, "waf_after": float,
                           "objective": float, "free": int, "enacted": bool, "moves": list},
                          {"pause_s": dict})
FLEET_DRAIN = _declare("fleet_drain", "The manager asked a job to drain a node for another.",
                       {"job": str, "node": str, "for_job": str})
FLEET_GROW = _declare("fleet_grow", "The manager grew a job by nodes (from a drain or free).",
                      {"job": str, "nodes": _Nodes, "from_job": str})
FLEET_STOP = _declare("fleet_stop", "The manager stopped a job at its checkpoint (below its "
                      "min_nodes): it is requeued inside the fleet.",
                      {"job": str, "nodes": int, "reason": str})
FLEET_MOVE_FAILED = _declare("fleet_move_failed", "A move could not be made (drain refused...).",
                             {"job": str, "reason": str})
FLEET_NODES = _declare("fleet_nodes", "A job's node count changed (its plan): the fleet's WAF now.",
                       {"job": str, "nodes": int, "counts": _Counts, "waf": float})
FLEET_JOB_STARTED = _declare("fleet_job_started", "The manager started a job of the fleet.",
                             {"job": str, "nodes": int, "run_dir": str, "pid": int},
                             {"attempt": int, "on_nodes": _Nodes})
FLEET_JOB_ENDED = _declare("fleet_job_ended", "A job of the fleet ended (its launcher's code).",
                           {"job": str, "code": int, "finished": bool, "nodes": int},
                           {"requeued": bool})
FLEET_RESUMED = _declare("fleet_resumed", "A new manager took the fleet over from its records.",
                         {"pid": int, "since_s": float, "pending": list, "jobs": dict})
FLEET_ENDED = _declare("fleet_ended", "Every job of the fleet ended.",
                       {"codes": dict, "seconds": float}, {"code": int})


class EventLog:
    """Append-only JSONL event file shared by all processes of a run (see module docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None, source: str = ""):
        self.path = Path(path) if path is not None else None
        self.source = source
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._warned = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run = runs.run_id(self.path.parent if self.path is not None else None)
        self.attempt = runs.attempt()

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event; returns it (as written). `fields` must be JSON-serialisable
        (anything else is written with str()). An undeclared kind, or a field missing from or
        unknown to its declaration (KINDS), is a programming error: TypeError at once (as for a
        wrong keyword argument; not a ValueError, which the recovery rounds catch as failures)."""
        check(kind, fields)
        event: dict[str, Any] = {"t": time.time(), "kind": kind}
        if self.source:
            event["source"] = self.source
        if self.run:
            event["run"] = self.run
        event["attempt"] = self.attempt
        event.update(fields)
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        human = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        logger.info("[%s] %s %s", self.source or "-", kind, human)
        if self.path is None:
            return event
        with self._lock:
            try:
                if self._fd is None:  # (never other users'; the group's with group_access: records/runs.py)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
                os.write(self._fd, line.encode())
            except OSError as e:
                if not self._warned:
                    logger.warning("event log %s cannot be written (%s); events are dropped",
                                   self.path, e)
                    self._warned = True
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def check(kind: str, fields: dict[str, Any]) -> None:
    """Raise TypeError unless `fields` are those that `kind` declares (KINDS)."""
    declared = KINDS.get(kind)
    if declared is None:
        raise TypeError(f"event kind {kind!r} is not declared in oobleck_hpc/records/events.py")
    missing = declared.fields.keys() - fields.keys()
    unknown = fields.keys() - declared.fields.keys() - declared.optional.keys()
    if missing or unknown:
        raise TypeError(f"event {kind!r}: missing fields {sorted(missing)}, "
                         f"undeclared fields {sorted(unknown)}")


def read_events(pattern: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of the files matching `pattern` (a path or a glob), sorted by time. A torn last
    line (a writer killed mid-write) is skipped."""
    events = [e for name in sorted(glob.glob(str(pattern))) for e in read_jsonl(name)]
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "-"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
