"""`oobleck-hpc fleet run` end to end (issue 32, local): three real jobs on one pool, a node of the
heaviest killed, a node moved to it from the lightest.

The fleet: jobs heavy / middle / light, weights 4 / 2 / 1, each gpt-tiny in fp64 on local nodes
of 1 worker, on a pool of 8 nodes. Their max_nodes (3 / 2 / -) make the first decision 3 / 2 / 3
(the planner's smallest plan is 2 nodes with f = 1, so heavy and light can each lose one and
keep training). heavy's job file kills its node2 in step 3 (`faults:`): heavy recovers in place
(2 nodes); the manager then re-solves with the moves' costs, and 4 x heavy's gain pays for
light's loss and both pauses: it drains one node of light (drain_agreed there) and grows heavy by
one (node3 joins, below the 3 nodes heavy started with). Every job must finish with every step
once and its losses and final parameters equal to its own failure-free fp64 reference
(`engine.reference_run`, as tests/test_recovery.py and operate/chaos.py check a run).

The fleet runs as a subprocess under a hard timeout; every process it started (the jobs'
launchers, their agents and workers) is killed by pid at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.operate.chaos import check_steps, max_rel_diff
from oobleck_hpc.records.events import read_events, read_jsonl

from test_recovery import TOL, job_dict

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"heavy": 160, "middle": 20, "light": 50}
WEIGHTS = {"heavy": 4, "middle": 2, "light": 1}
MAX_NODES = {"heavy": 3, "middle": 2, "light": None}
KILL = {"node": 2, "step": 3, "phase": "backward", "kind": "kill"}
TIMEOUT_S = 240


def write_fleet(tmp_path: Path) -> Path:
    entries = []
    for name, steps in STEPS.items():
        # cluster.nodes 3: the fault's node index is checked against it (the fleet sets the count)
        data = job_dict(tmp_path / name, nodes=3, gpus=1, steps=steps,
                        faults=[KILL] if name == "heavy" else [])
        data["name"] = name
        data["cluster"]["kill_grace_s"] = 5.0
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        entry = {"job": f"{name}.yaml", "name": name, "weight": WEIGHTS[name]}
        if MAX_NODES[name] is not None:
            entry["max_nodes"] = MAX_NODES[name]
        entries.append(entry)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"name": "fleet-test", "pool": {"nodes": 8},
                                    "mtbf_hours": 3.0, "jobs": entries}))
    return path


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each job's failure-free fp64 run in one process: (losses, final parameters)."""
    import torch

    from oobleck_hpc.engine import reference_run

    tmp = tmp_path_factory.mktemp("refs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the machine's cores are busy with the fleet's workers too)
    try:
        return {name: reference_run(job_from_dict(job_dict(tmp, nodes=3, gpus=1, steps=steps)),
                                    steps)
                for name, steps in STEPS.items()}
    finally:
        torch.set_num_threads(threads)


def kill_everything(fleet: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the fleet's session, each job launcher's session (pids from the fleet's
    events) and the process groups of every job's agents (agents.json), matched by process
    group and command line so that a recycled pid is never hit."""
    groups = {fleet.pid}
    events = run_dir / "events.jsonl"
    for e in read_events(events) if events.exists() else []:
        if e.get("kind") == "fleet_job_started":
            groups.add(e["pid"])
    for agents in run_dir.glob("*/agents.json"):
        try:
            groups |= set(json.loads(agents.read_text()).values())
        except ValueError:
            pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if pgid in groups and b"oobleck_hpc" in cmdline:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    fleet.wait()


def run_fleet(tmp_path: Path) -> tuple[int | None, Path]:
    path = write_fleet(tmp_path)
    run_dir = tmp_path / "fleet-run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "fleet.log", "w") as log:
        fleet = subprocess.Popen([sys.executable, "-m", "oobleck_hpc", "fleet", "run",
                                  str(path), "--run-dir", str(run_dir)], cwd=tmp_path, env=env,
                                 stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | None = fleet.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_everything(fleet, run_dir)
    return code, run_dir


def kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("kind") == kind]


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_node_moves_from_the_lightest_job_to_the_heaviest_after_its_loss(tmp_path, references):
    code, run_dir = run_fleet(tmp_path)
    where = f"(fleet: {run_dir}, log {tmp_path / 'fleet.log'})"
    assert code == 0, f"fleet exit code {code} {where}"
    fleet = read_events(run_dir / "events.jsonl")
    started = kinds(fleet, "fleet_started")[0]
    assert started["nodes"] == {"heavy": 3, "middle": 2, "light": 3}, started

    heavy = read_events(run_dir / "heavy" / "events.jsonl")
    recovered = [e for e in kinds(heavy, "recovered") if e["lost"]]
    assert recovered and recovered[0]["lost"] == ["node2"], f"no recovery in place {where}"

    # the decision after heavy's recovery: light gives one node to heavy, WAF before/after
    decision = next(e for e in kinds(fleet, "fleet_decision") if e["trigger"] == "heavy")
    assert decision["enacted"] and decision["nodes_before"]["heavy"] == 2, decision
    assert decision["nodes_after"] == {"heavy": 3, "middle": 2, "light": 2}, decision
    assert decision["waf_after"] > decision["waf_before"] > 0, decision
    assert decision["t"] > recovered[0]["t"], "the manager decided before heavy recovered"
    drain = kinds(fleet, "fleet_drain")
    assert [(e["job"], e["for_job"]) for e in drain] == [("light", "heavy")], drain
    light = read_events(run_dir / "light" / "events.jsonl")
    agreed = kinds(light, "drain_agreed")
    assert agreed and agreed[0]["nodes"] == [drain[0]["node"]], f"light did not drain {where}"
    # (light may get a node back from middle's, if middle ends first: below its start)
    grow = [e for e in kinds(fleet, "fleet_grow") if e["job"] == "heavy"]
    assert [e["from_job"] for e in grow] == ["light"], grow
    assert grow[0]["t"] >= agreed[0]["t"], "heavy grew before light's node left"
    joined = kinds(heavy, "node_joined")
    assert joined and joined[0]["node"] == grow[0]["nodes"][0], f"no node joined heavy {where}"
    assert [e for e in kinds(fleet, "fleet_nodes") if e["job"] == "heavy"][-2]["nodes"] == 3

    for name, (losses, params) in references.items():
        rows = read_jsonl(run_dir / name / "metrics.jsonl")
        assert check_steps(rows, STEPS[name]), f"{name}: steps missing or twice {where}"
        by_step = {r["step"]: r["loss"] for r in rows}
        np.testing.assert_allclose([by_step[k] for k in range(1, STEPS[name] + 1)], losses,
                                   rtol=TOL)
        diff = max_rel_diff(run_dir / name / "final", params)
        assert diff is not None and diff <= TOL, f"{name}: final parameters differ by {diff}"
    ended = {e["job"]: e for e in kinds(fleet, "fleet_job_ended")}
    assert all(ended[n]["finished"] for n in STEPS), ended

    status = subprocess.run([sys.executable, "-m", "oobleck_hpc", "fleet", "status",
                             str(run_dir), "--json"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=True)
    rep = json.loads(status.stdout)
    assert [k for _, k in rep["jobs"]["heavy"]["nodes_over_time"]] == [3, 2, 3, 0], rep
    assert rep["jobs"]["light"]["nodes_over_time"][1][1] == 2, rep
    assert rep["ended"]["codes"] == {n: 0 for n in STEPS}, rep
