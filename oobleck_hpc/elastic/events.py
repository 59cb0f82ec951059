"""The run's event log: one JSON object per line in `<run_dir>/events.jsonl`, plus a short human line.

Every transition of a job (failure detected, agreement reached, plan chosen, groups rebuilt, bytes
transferred, first step committed after recovery, ...) is one event:

    log = EventLog(run_dir / "events.jsonl", source="node3")
    log.emit("failure_detected", node="node1", how="connection_lost")

writes

    {"t": 1763788000.123456, "kind": "failure_detected", "source": "node3", "run": "20261125-041502-9f3a",
     "attempt": 0, "node": "node1", ...}

and logs `[node3] failure_detected node=node1 how=connection_lost` to the `oobleck_hpc.events`
logger. `t` is wall-clock Unix time (time.time()): events of different processes on one machine
(or on nodes with synchronised clocks) can be merged and subtracted. `run` and `attempt` name the
run and the attempt (requeue) that wrote the event (oobleck_hpc/runs.py); steps are numbered from
1, as in the metrics file and on the console (`step` k = the k-th training step).

Concurrency: every event is one `os.write` of one line to a file opened with O_APPEND, so the
lines of many processes on one machine never interleave (the kernel serialises appends on local
file systems). On NFS, O_APPEND is not atomic across hosts: give each node its own file there
(e.g. `events.<node>.jsonl`) and merge them with `read_events`, which accepts a glob.

The log never raises into the caller: an event that cannot be written (disk full, directory
removed) is reported once on the logger and dropped -- training does not stop for a log line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from oobleck_hpc import runs
from oobleck_hpc.runs import read_jsonl  # (re-exported: the readers import it from here)

logger = logging.getLogger("oobleck_hpc.events")


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
        (anything else is written with str())."""
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
                if self._fd is None:  # (never other users'; the group's with group_access: runs.py)
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
