"""`oobleck-hpc kill-node RUN_DIR NODE [--signal KILL|STOP|TERM]`: a fault of a running local job,
from another shell.

It must act at once: it runs while the job's workers keep every core busy, where a process
gets a small share of a core and each module it imports costs many times its CPU time (issue
27: 2-7.5 s before the signal, with the CLI's whole command set and the local launcher
imported). So this module imports only what sending the signal and recording it needs (the
event log), and `oobleck-hpc kill-node` imports only this module and the wording of its
console line (oobleck_hpc/cli.py, story.KILLED).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from oobleck_hpc.records.events import EventLog


def kill_node(run_dir: str | Path, node: str, sig: int = signal.SIGKILL) -> float:
    """Send `sig` to one node of the local job running in `run_dir`: its agent's process group
    (agent + workers, RUN_DIR/agents.json), as when a machine dies (or hangs). Returns the time
    it was sent (also written to the events: `node_killed`, with the signal's name)."""
    path = Path(run_dir) / "agents.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is a local job running with run dir "
                                f"{run_dir}? (`oobleck-hpc run` writes it at start)")
    pids = json.loads(path.read_text())
    if node not in pids:
        raise KeyError(f"node {node!r} is not part of the job in {run_dir} (nodes: "
                       f"{', '.join(pids)})")
    log = EventLog(Path(run_dir) / "events.jsonl", source="kill-node")
    t = time.time()
    log.emit("node_killed", node=node, signal=signal.Signals(sig).name, pid=pids[node])
    log.close()
    os.killpg(pids[node], sig)
    return t
