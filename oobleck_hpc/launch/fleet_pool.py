"""The nodes of a Slurm fleet's allocation and which job holds each (`oobleck-hpc fleet submit`:
launch/fleet.py runs the manager in the allocation's batch script, each job's launcher as
`oobleck-hpc run JOB --on-nodes N1,N2`, its agents one Slurm step per node: slurm_steps.py).

The manager decides how many nodes each job gets (fleet/manager.py); this picks which.
`take(job, k, tag)` gives the job k free nodes, recorded as the job's from now on, under the
tag of the action (a start or a grow) that took them: a manager that takes over from the
records and does the action again gets the same nodes back. A node is free when
- no job holds it and Slurm still counts it in the allocation (a dead node leaves it:
  bootstrap/environment.current_job_nodes), or
- the job that holds it gave it up: its agent's step on the node ended after the node was
  given (the job's RUN_DIR/steps.json, which its launcher keeps), or its launcher ended.
A node given to a job that never started a step on it (its discovery left the node out) stays
the job's until the job ends. `held` is part of the manager's records (launch/fleet.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oobleck_hpc.launch.slurm_steps import STEPS_FILE
from oobleck_hpc.polling import wait_until

TAKE_TIMEOUT_S = 60.0
"""How long a start or a grow waits for its nodes: a drained node's agent leaves seconds after
its job agreed to let it go."""


@dataclass
class SlurmPool:
    job_id: str
    """The allocation's Slurm job id."""
    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    """node -> {"job": its job, "since": when it was given (time.time()), "tag": the action's}."""

    def free(self, run_dirs: dict[str, Path], running: Callable[[str], bool]) -> list[str]:
        """The allocation's free nodes, in Slurm's order (module docstring). `running(job)`:
        whether the job's launcher still holds its nodes."""
        from oobleck_hpc.bootstrap.environment import current_job_nodes

        steps = {job: _steps(d) for job, d in run_dirs.items()}
        out = []
        for node in current_job_nodes(self.job_id):
            h = self.held.get(node)
            if h is None or not running(h["job"]):
                out.append(node)
                continue
            step = steps[h["job"]].get(node)
            if step and step.get("ended") is not None and step["started"] >= h["since"]:
                out.append(node)
        return out

    def take(self, job: str, count: int, tag: str, run_dirs: dict[str, Path],
             running: Callable[[str], bool], timeout_s: float = TAKE_TIMEOUT_S) -> list[str]:
        """`count` free nodes for `job` (those it already took under `tag`, if any); waits up to
        `timeout_s` for them (TimeoutError)."""
        mine = [n for n, h in self.held.items() if h["job"] == job and h["tag"] == tag]
        if mine:
            return mine
        def enough() -> list[str] | None:
            free = self.free(run_dirs, running)
            return free[:count] if len(free) >= count else None

        chosen = wait_until(enough, timeout_s, f"{count} free nodes of allocation "
                            f"{self.job_id} for {job}", every_s=0.2)
        for node in chosen:
            self.held[node] = {"job": job, "since": time.time(), "tag": tag}
        return chosen


def _steps(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / STEPS_FILE).read_text())
    except (OSError, ValueError):
        return {}
