"""The real per-node agents (oobleck_hpc.control.agent, elastic control plane) under the real Slurm
controller of slurm/dev-cluster.sh, with the echo worker (oobleck_hpc/testing/echo_worker.py) as
each node's 2 workers: a node killed or frozen mid-run is agreed away by the survivors, and the
job finishes on them -- same job id, no requeue."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from oobleck_hpc.bootstrap import current_job_nodes
from oobleck_hpc.config import load_job
from helpers import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES = ["n1", "n2", "n3", "n4"]
AGENT = ("{python} -m oobleck_hpc.control.agent --job {job} --run-dir {run_dir} "
         "-- {python} -m oobleck_hpc.testing.echo_worker")


def memberships(run_dir: Path, worker: str) -> list[dict]:
    path = run_dir / "workers" / f"{worker}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "membership"]


def events(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if line.strip()]
    return [r for r in rows if r["kind"] == kind]


def start(tmp_path: Path, name: str):
    from oobleck_hpc.launch.slurm import submit

    run_dir = tmp_path / name
    job_file = tmp_path / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump({
        "name": name, "run_dir": str(run_dir),
        "cluster": {"launch": "slurm", "nodes": 4, "gpus_per_node": 2, "device": "cpu"},
        "fault_tolerance": {"heartbeat_s": 0.5, "lease_s": 3.0},
        "slurm": {"time_min": 5, "agent_command": AGENT},
    }))
    submitted = submit(load_job(job_file))
    workers = [f"{n}.{r}" for n in NODES for r in (0, 1)]
    wait_until(lambda: all(memberships(run_dir, w) for w in workers), 90,
               "every worker to see generation 0")
    return submitted, run_dir


def finish(submitted, run_dir: Path, lost: str):
    (run_dir / "ctl").mkdir(exist_ok=True)
    (run_dir / "ctl" / "STOP").touch()  # the echo workers say "done"; agents exit 0
    result = submitted.result()
    assert (result.job_id, result.restart_count) == (submitted.job_id, 0)
    assert result.lost_nodes == [lost] and result.exit_code == 0
    rows = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", submitted.job_id, "-o",
                           "JobID,State"], capture_output=True, text=True, check=True).stdout
    states = [line.split("|") for line in rows.splitlines() if line.strip()]
    assert {jid for jid, _ in states} == {submitted.job_id}
    assert "REQUEUED" not in {st for _, st in states}


def check_generation_1(run_dir: Path, lost: str) -> None:
    survivors = [n for n in NODES if n != lost]
    for w in [f"{n}.{r}" for n in survivors for r in (0, 1)]:
        last = memberships(run_dir, w)[-1]
        assert (last["gen"], last["nodes"], last["lost"]) == (1, survivors, [lost]), w
    agreed = [e for e in events(run_dir, "agreement_reached") if e["gen"] == 1]
    assert {e["source"] for e in agreed} == set(survivors)
    assert all(e["nodes"] == survivors and e["lost"] == [lost] for e in agreed)


@pytest.mark.timeout(180)
def test_agents_agree_a_killed_node_away_and_finish(slurm_cluster, tmp_path):
    submitted, run_dir = start(tmp_path, "agents-kill")
    subprocess.run([str(slurm_cluster), "kill-node", "n3"], check=True, capture_output=True)
    survivors = [f"{n}.{r}" for n in ("n1", "n2", "n4") for r in (0, 1)]
    wait_until(lambda: all(memberships(run_dir, w)[-1]["gen"] == 1 for w in survivors), 30,
               "the survivors' workers to get generation 1")
    check_generation_1(run_dir, "n3")
    # Slurm drops n3 from the job (~10 s) and the job goes on: finish it.
    wait_until(lambda: "n3" not in current_job_nodes(submitted.job_id), 40, "Slurm to drop n3")
    finish(submitted, run_dir, "n3")


@pytest.mark.timeout(180)
def test_agents_fence_a_frozen_node_and_finish(slurm_cluster, tmp_path):
    submitted, run_dir = start(tmp_path, "agents-freeze")
    subprocess.run([str(slurm_cluster), "freeze-node", "n2"], check=True, capture_output=True)
    try:
        survivors = [f"{n}.{r}" for n in ("n1", "n3", "n4") for r in (0, 1)]
        wait_until(lambda: all(memberships(run_dir, w)[-1]["gen"] == 1 for w in survivors), 30,
                   "the survivors to agree n2 away (lease expiry)")
        check_generation_1(run_dir, "n2")
        wait_until(lambda: "n2" not in current_job_nodes(submitted.job_id), 40,
                   "Slurm to drop n2")
    finally:
        subprocess.run([str(slurm_cluster), "thaw-node", "n2"], check=True, capture_output=True)
    finish(submitted, run_dir, "n2")
