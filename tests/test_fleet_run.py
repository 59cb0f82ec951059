"""`oobleck-hpc fleet run` end to end (issue 32, local): three real jobs on one pool, a node of the
heaviest killed, a node moved to it from the lightest, the manager killed and taken over; and a
job that falls back to its checkpoint, requeued inside the fleet.

The fleet: jobs heavy / middle / light, weights 4 / 2 / 1, each gpt-tiny in fp64 on local nodes
of 1 worker, on a pool of 8 nodes. Their max_nodes (3 / 2 / -) make the first decision 3 / 2 / 3
(the planner's smallest plan is 2 nodes with f = 1, so heavy and light can each lose one and
keep training). Once every job started, the manager is SIGKILLed: the jobs train on. heavy's
job file kills its node2 in step 3 (`faults:`): heavy recovers in place (2 nodes) while no
manager runs; then a new one takes over from the records (`fleet run --resume`), reads what
happened meanwhile, re-solves with the moves' costs, and 4 x heavy's gain pays for
light's loss and both pauses: it drains one node of light (drain_agreed there) and grows heavy by
one (node3 joins, below the 3 nodes heavy started with). Every job must finish with every step
once and its losses and final parameters equal to its own failure-free fp64 reference
(`engine.reference_run`, as tests/test_recovery.py and operate/chaos.py check a run).

Each manager runs as a subprocess under a hard timeout; every process they started (the jobs'
launchers, their agents and workers) is killed by pid at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.operate.chaos import check_steps, max_rel_diff
from oobleck_hpc.operate.cleanup import kill_fleet
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
    return reference_runs(tmp_path_factory.mktemp("refs"), STEPS)


def reference_runs(tmp: Path, steps_by_job: dict[str, int]) -> dict[str, tuple]:
    import torch

    from oobleck_hpc.engine import reference_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the machine's cores are busy with the fleet's workers too)
    try:
        return {name: reference_run(job_from_dict(job_dict(tmp, nodes=3, gpus=1, steps=steps)),
                                    steps)
                for name, steps in steps_by_job.items()}
    finally:
        torch.set_num_threads(threads)


def wait_for(path: Path, kind: str, count: int, deadline: float, where: str,
             lost: bool = False) -> None:
    """Until `path` holds `count` events of `kind` (`lost`: that lost a node)."""
    while time.monotonic() < deadline:
        events = read_events(path) if path.exists() else []
        if len([e for e in kinds(events, kind) if e.get("lost") or not lost]) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {count} {kind} events in {path} {where}")


def run_fleet(tmp_path: Path) -> tuple[int | None, Path]:
    """The fleet, its manager SIGKILLed once every job started, a new one started with
    --resume once heavy recovered from its loss: the second manager's exit code."""
    path = write_fleet(tmp_path)
    run_dir = tmp_path / "fleet-run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "oobleck_hpc", "fleet", "run", str(path), "--run-dir",
           str(run_dir)]
    deadline = time.monotonic() + TIMEOUT_S
    where = f"(log {tmp_path / 'fleet.log'})"
    managers: list[subprocess.Popen] = []
    with open(tmp_path / "fleet.log", "w") as log:
        def manager(*extra: str) -> subprocess.Popen:
            managers.append(subprocess.Popen(cmd + list(extra), cwd=tmp_path, env=env,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True))
            return managers[-1]
        try:
            first = manager()
            wait_for(run_dir / "events.jsonl", "fleet_job_started", len(STEPS), deadline, where)
            first.send_signal(signal.SIGKILL)  # (only the manager: each job has its session)
            assert first.wait(timeout=30) == -signal.SIGKILL
            wait_for(run_dir / "heavy" / "events.jsonl", "recovered", 1, deadline, where,
                     lost=True)
            code: int | None = manager("--resume").wait(timeout=deadline - time.monotonic())
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_fleet(managers, run_dir)
    return code, run_dir


def kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("kind") == kind]


def check_jobs(run_dir: Path, references: dict[str, tuple], steps: dict[str, int],
               where: str) -> None:
    """Every job of the fleet ran each step once per attempt, and its losses (of a step
    replayed after a fallback: its last attempt's) and final parameters equal its own
    failure-free fp64 reference's."""
    for name, (losses, params) in references.items():
        rows = read_jsonl(run_dir / name / "metrics.jsonl")
        assert check_steps(rows, steps[name]), f"{name}: steps missing or twice {where}"
        last = {r["step"]: r["loss"] for r in rows}
        np.testing.assert_allclose([last[k] for k in range(1, steps[name] + 1)], losses,
                                   rtol=TOL)
        diff = max_rel_diff(run_dir / name / "final", params)
        assert diff is not None and diff <= TOL, f"{name}: final parameters differ by {diff}"


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_node_moves_from_the_lightest_job_to_the_heaviest_after_its_loss(tmp_path, references):
    code, run_dir = run_fleet(tmp_path)
    where = f"(fleet: {run_dir}, log {tmp_path / 'fleet.log'})"
    assert code == 0, f"fleet exit code {code} {where}"
    fleet = read_events(run_dir / "events.jsonl")
    started = kinds(fleet, "fleet_started")[0]
    assert started["nodes"] == {"heavy": 3, "middle": 2, "light": 3}, started
    resumed = kinds(fleet, "fleet_resumed")
    assert len(resumed) == 1 and len(kinds(fleet, "fleet_job_started")) == 3, resumed

    heavy = read_events(run_dir / "heavy" / "events.jsonl")
    recovered = [e for e in kinds(heavy, "recovered") if e["lost"]]
    assert recovered and recovered[0]["lost"] == ["node2"], f"no recovery in place {where}"

    # the decision after heavy's recovery: light gives one node to heavy, WAF before/after
    decision = next(e for e in kinds(fleet, "fleet_decision") if e["trigger"] == "heavy")
    assert decision["enacted"] and decision["nodes_before"]["heavy"] == 2, decision
    assert decision["nodes_after"] == {"heavy": 3, "middle": 2, "light": 2}, decision
    assert decision["waf_after"] > decision["waf_before"] > 0, decision
    assert decision["t"] > resumed[0]["t"] > recovered[0]["t"], "not decided by the new manager"
    assert decision["pause_s"]["heavy"] == pytest.approx(recovered[0]["seconds"], abs=1e-3)
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

    check_jobs(run_dir, references, STEPS, where)
    ended = {e["job"]: e for e in kinds(fleet, "fleet_job_ended")}
    assert all(ended[n]["finished"] for n in STEPS), ended

    status = subprocess.run([sys.executable, "-m", "oobleck_hpc", "fleet", "status",
                             str(run_dir), "--json"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=True)
    rep = json.loads(status.stdout)
    assert [k for _, k in rep["jobs"]["heavy"]["nodes_over_time"]] == [3, 2, 3, 0], rep
    assert rep["jobs"]["light"]["nodes_over_time"][1][1] == 2, rep
    assert rep["ended"]["codes"] == {n: 0 for n in STEPS}, rep
    assert [m["move"] for m in rep["moves"]][0] == "resumed", rep["moves"]


# -- a job below its minimum: requeued inside the fleet -------------------------------------------
FALL_STEPS = {"main": 40, "frail": 12}


@pytest.fixture(scope="module")
def fall_references(tmp_path_factory):
    return reference_runs(tmp_path_factory.mktemp("fall-refs"), FALL_STEPS)


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_job_below_its_minimum_falls_back_and_is_requeued_when_nodes_free_up(
        tmp_path, fall_references):
    """main (weight 2, exactly 2 nodes) and frail (min_nodes 2 in the fleet, checkpoints every
    3 steps) share 4 nodes. frail's node1 is killed in step 5: it recovers in place on 1 node,
    below its minimum, so the manager stops it at its checkpoint (its launcher exits 75). Its
    survivor is free, too few to start it again (main would have to stop); when main finishes,
    frail starts again (attempt 1) on the nodes free, resumes from its checkpoint and
    finishes. Both end equal to their own failure-free fp64 references."""
    entries = []
    for name, steps in FALL_STEPS.items():
        data = job_dict(tmp_path / name, nodes=2, gpus=1, steps=steps,
                        faults=[{"node": 1, "step": 5, "phase": "backward", "kind": "kill"}]
                        if name == "frail" else [])
        data["name"] = name
        data["cluster"]["kill_grace_s"] = 5.0
        data["checkpoint"] = {"dir": str(tmp_path / f"{name}-ckpt"), "every_steps": 3}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        entries.append({"job": f"{name}.yaml", "name": name, **(
            {"weight": 2, "min_nodes": 2, "max_nodes": 2} if name == "main"
            else {"weight": 1, "min_nodes": 2})})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"name": "fall", "pool": {"nodes": 4}, "jobs": entries}))
    run_dir = tmp_path / "fleet-run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    where = f"(fleet: {run_dir}, log {tmp_path / 'fleet.log'})"
    with open(tmp_path / "fleet.log", "w") as log:
        fleet = subprocess.Popen([sys.executable, "-m", "oobleck_hpc", "fleet", "run", str(path),
                                  "--run-dir", str(run_dir)], cwd=tmp_path, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            code = fleet.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_fleet([fleet], run_dir)
    assert code == 0, f"fleet exit code {code} {where}"
    events = read_events(run_dir / "events.jsonl")
    assert kinds(events, "fleet_started")[0]["nodes"] == {"main": 2, "frail": 2}
    ends = [(e["job"], e["code"], e.get("requeued")) for e in kinds(events, "fleet_job_ended")]
    assert ends == [("frail", 75, True), ("main", 0, False), ("frail", 0, False)], ends
    starts = [(e["job"], e.get("attempt", 0), e["t"]) for e in kinds(events, "fleet_job_started")]
    main_end = next(e["t"] for e in kinds(events, "fleet_job_ended") if e["job"] == "main")
    assert [(j, a) for j, a, _ in starts] == [("main", 0), ("frail", 0), ("frail", 1)], starts
    assert starts[-1][2] >= main_end, "frail started again before nodes were free"
    frail = read_events(run_dir / "frail" / "events.jsonl")
    assert [e["job"] for e in kinds(events, "fleet_stop")] == ["frail"], events
    assert kinds(frail, "stopping") and kinds(frail, "restored"), f"no stop/resume {where}"
    check_jobs(run_dir, fall_references, FALL_STEPS, where)
