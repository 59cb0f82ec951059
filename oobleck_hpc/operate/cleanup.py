"""Killing what a run left behind, by pid and process group, never by name: a local job's
launcher and its agents' process groups (RUN_DIR/agents.json), and a whole fleet run (its
managers, each job's launcher, their agents). Used by `chaos`, `fleet chaos`, `fleet run` and
the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from oobleck_hpc.records import events as ev


def kill_leftovers(launcher: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's session and every oobleck_hpc process in the process groups of
    the agents named in RUN_DIR/agents.json (agents run in their own sessions). Processes are
    matched by process group and command line, so a recycled pid is never hit."""
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()
    kill_agents(run_dir)


def agent_groups(run_dir: Path) -> set[int]:
    """The process groups of the agents named in RUN_DIR/agents.json (none if it is not
    there)."""
    try:
        return set(json.loads((run_dir / "agents.json").read_text()).values())
    except (FileNotFoundError, ValueError):
        return set()


def kill_agents(run_dir: Path) -> None:
    """SIGKILL every oobleck_hpc process in the process groups of the agents named in
    RUN_DIR/agents.json (matched by process group and command line: `kill_leftovers`)."""
    kill_groups(agent_groups(run_dir))


def kill_fleet(managers: Sequence[subprocess.Popen], run_dir: Path) -> None:
    """SIGKILL whatever a fleet run left (`fleet run`, launch/fleet.py): its managers'
    sessions, each job launcher's session (pids from the fleet's `fleet_job_started` events)
    and the process groups of every job's agents (RUN_DIR/<job>/agents.json)."""
    groups = {m.pid for m in managers}
    events = run_dir / "events.jsonl"
    groups |= {e["pid"] for e in (ev.read_events(events) if events.exists() else [])
               if e.get("kind") == ev.FLEET_JOB_STARTED}
    for job in run_dir.glob("*/agents.json"):
        groups |= agent_groups(job.parent)
    kill_groups(groups)
    for m in managers:
        m.wait()


def kill_groups(groups: set[int]) -> None:
    """SIGKILL every oobleck_hpc process in these process groups (matched by process group
    and command line, so that a recycled pid is never hit)."""
    if not groups:
        return
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if pgid in groups and b"oobleck_hpc" in cmdline:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
