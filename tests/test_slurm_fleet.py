"""`oobleck-hpc fleet submit` on the real local Slurm cluster (issue 32): a fleet of two jobs in
ONE allocation of the cluster's 4 nodes, and a node that moves between them inside it.

heavy (weight 4, f = 1, 1 worker per node, at most 2 nodes) and light (weight 1, f = 0 with 2
workers per node: its plan is two 1-node pipelines, so it can give one up, and 1 node is worth
something to it), each gpt-tiny in fp64: the first decision gives each 2 nodes. heavy's job file kills its node1 in step 3 (`faults:`: the node's
agent and worker die at once; its step ends, the node stays in the allocation): heavy recovers
in place on 1 node. Then the manager re-solves and 4 x heavy's gain pays for light's loss: it
drains light's last node (drain_agreed there) and grows heavy by one (a free node of the
allocation, its agent a new step with --join: launch/slurm_steps.py), without a trip through
the queue -- sacct shows one job, the fleet's allocation, COMPLETED. The manager is SIGKILLed
once both jobs started: they train on, and the batch script starts a new manager that takes
over from the records (launch/slurm_driver.FleetDriver) and makes the move. Both jobs finish with every
step once, their losses and final parameters equal to their own failure-free fp64 reference.

One test, hard timeout; the allocation is cancelled by its job id at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from oobleck_hpc.launch.fleet_job import process_start
from oobleck_hpc.records.events import read_events

from helpers import wait_until
from test_fleet_run import check_jobs, kinds
from test_recovery import job_dict
from test_slurm_training import sacct_states

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
STEPS = {"heavy": 400, "light": 250}
WEIGHTS = {"heavy": 4, "light": 1}
KILL = {"node": 1, "step": 3, "phase": "backward", "kind": "kill"}
TIMEOUT_S = 420


def job(run_dir: Path, name: str) -> dict:
    if name == "heavy":
        return job_dict(run_dir, nodes=2, gpus=1, steps=STEPS[name], faults=[KILL])
    return job_dict(run_dir, nodes=2, gpus=2, steps=STEPS[name], f=0)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each job's failure-free fp64 run in one process: (losses, final parameters)."""
    import torch

    from oobleck_hpc.config import job_from_dict
    from oobleck_hpc.engine import reference_run

    tmp = tmp_path_factory.mktemp("slurm-fleet-refs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: reference_run(job_from_dict(job(tmp, name)), steps)
                for name, steps in STEPS.items()}
    finally:
        torch.set_num_threads(threads)


def write_fleet(tmp_path: Path) -> Path:
    entries = []
    for name in STEPS:
        data = job(tmp_path / name, name)
        data["name"] = name
        data["cluster"]["kill_grace_s"] = 5.0
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        entries.append({"job": f"{name}.yaml", "name": name, "weight": WEIGHTS[name],
                        **({"max_nodes": 2} if name == "heavy" else {})})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"name": "slurm-fleet", "pool": {"nodes": 4},
                                    "slurm": {"time_min": 15}, "jobs": entries}))
    return path


def kill_manager(run_dir: Path, deadline: float) -> None:
    """SIGKILL the fleet's manager (its pid and start time from its records) once both jobs
    started: the batch script starts a new one, which takes over from the records."""
    events = run_dir / "events.jsonl"
    wait_until(lambda: events.exists() and len(kinds(read_events(events),
                                                     "fleet_job_started")) == 2,
               deadline - time.monotonic(), f"both jobs to start ({events})")
    saved = json.loads((run_dir / "manager.json").read_text())
    assert process_start(saved["pid"]) == saved["pid_start"], saved  # (never a recycled pid)
    os.kill(saved["pid"], signal.SIGKILL)


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_node_moves_between_jobs_inside_one_allocation(slurm_cluster, tmp_path, references):
    path = write_fleet(tmp_path)
    run_dir = tmp_path / "fleet-run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    where = f"(fleet: {run_dir}, its batch log under {run_dir / 'submitit'})"
    deadline = time.monotonic() + TIMEOUT_S
    with open(tmp_path / "submit.log", "w") as log:
        submit = subprocess.Popen([sys.executable, "-m", "oobleck_hpc", "fleet", "submit",
                                   str(path), "--run-dir", str(run_dir), "--wait"], cwd=tmp_path,
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            kill_manager(run_dir, deadline)
            submit.wait(timeout=max(1.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, TimeoutError):
            submit.kill()
            submit.wait()
        finally:  # (the allocation, by its id: every step of every job in it ends)
            ids = {p.name.split("_")[0] for p in (run_dir / "submitit").glob("*_submitted.pkl")}
            for job_id in ids:
                subprocess.run(["scancel", job_id], timeout=60)
    out = (tmp_path / "submit.log").read_text()
    assert submit.returncode == 0, f"fleet submit exited {submit.returncode}: {out} {where}"

    fleet = read_events(run_dir / "events.jsonl")
    assert len(kinds(fleet, "fleet_resumed")) == 1, f"no manager took over {where}"
    started = kinds(fleet, "fleet_job_started")
    assert {e["job"]: len(e["on_nodes"]) for e in started} == {"heavy": 2, "light": 2}, started
    assert not set(started[0]["on_nodes"]) & set(started[1]["on_nodes"]), started
    heavy = read_events(run_dir / "heavy" / "events.jsonl")
    recovered = [e for e in kinds(heavy, "recovered") if e["lost"]]
    assert recovered and recovered[0]["lost"] == [started[0]["on_nodes"][1]], \
        f"no recovery in place {where}"
    drain = kinds(fleet, "fleet_drain")
    assert [(e["job"], e["for_job"]) for e in drain] == [("light", "heavy")], drain
    light = read_events(run_dir / "light" / "events.jsonl")
    agreed = kinds(light, "drain_agreed")
    assert agreed and agreed[0]["nodes"] == [drain[0]["node"]], f"light did not drain {where}"
    grow = kinds(fleet, "fleet_grow")
    assert [(e["job"], e["from_job"]) for e in grow] == [("heavy", "light")], grow
    joined = kinds(heavy, "node_joined")  # (a node heavy had before joins as n2~2: wire.py)
    assert joined and joined[0]["node"].split("~")[0] == grow[0]["nodes"][0], \
        f"no node joined heavy {where}"
    assert [e["nodes"] for e in kinds(heavy, "plan_chosen")][-1] == 2, where

    check_jobs(run_dir, references, STEPS, where)
    ended = kinds(fleet, "fleet_ended")
    assert ended and ended[0]["codes"] == {"heavy": 0, "light": 0}, ended
    (job_id,) = ids  # one allocation: nothing went through the queue again
    states = wait_until(lambda: (s := sacct_states(job_id)) and s[-1][1] == "COMPLETED" and s,
                        30, f"sacct to show job {job_id} COMPLETED")
    assert {st for _, st in states} == {"COMPLETED"}, states
