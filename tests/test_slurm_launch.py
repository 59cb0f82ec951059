"""Launch through a real Slurm controller (the local cluster of slurm/dev-cluster.sh).

The per-node program is `python -m oobleck_hpc.bootstrap probe`: it reads the MPI discovery's
roster, binds its published port, records its NodeEnvironment and then beats every 0.2 s for a
while, so the tests can see which nodes kept running after a node was killed or frozen.

Both launch paths leave the run's files private (oobleck_hpc/records/runs.py, "Private"): `submit`
0700 / 0600; the batch script, here with the job's `group_access`, 0750 / 0640.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from oobleck_hpc.config import load_job
from helpers import not_private, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
NODES = ["n1", "n2", "n3", "n4"]
PROBE = "{python} -m oobleck_hpc.bootstrap probe --job {job} --run-dir {run_dir} --seconds %s"


def write_job(tmp_path: Path, name: str, seconds: float, probe_args: str = "",
              group_access: bool = False) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "run_dir": str(tmp_path / name),
        "group_access": group_access,
        "cluster": {"launch": "slurm", "nodes": 4, "gpus_per_node": 2, "device": "cpu"},
        "slurm": {"time_min": 5, "agent_command": PROBE % seconds + probe_args},
    }))
    return path


def sacct_rows(job_id: str) -> list[tuple[str, str]]:
    """(JobID, State) of every record of the job allocation, requeued runs included (-D)."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
                         capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")[:2]) for line in out.splitlines() if line.strip()]


def assert_one_job_completed(job_id: str, restarts: int | None = 0) -> list[tuple[str, str]]:
    """sacct shows one job id, COMPLETED at the end, requeued `restarts` times (None: any)."""
    rows = wait_until(lambda: (r := sacct_rows(job_id)) and r[-1][1] == "COMPLETED" and r,
                      30, f"sacct to show job {job_id} COMPLETED")
    assert {jid for jid, _ in rows} == {job_id}, rows
    assert restarts is None or sum(state == "REQUEUED" for _, state in rows) == restarts, rows
    return rows


def job_nodes(job_id: str) -> list[str]:
    from oobleck_hpc.bootstrap import current_job_nodes
    return current_job_nodes(job_id)


def probes(run_dir: Path) -> dict[str, dict]:
    out = {}
    for node in NODES:
        try:
            out[node] = json.loads((run_dir / "probe" / f"{node}.json").read_text())
        except (OSError, ValueError):
            pass
    return out


def last_beat(run_dir: Path, node: str) -> float:
    lines = (run_dir / "probe" / f"{node}.beats").read_text().split("\n")
    return float([line for line in lines if line.strip()][-1].split()[0])


def check_discovery(run_dir: Path, job_id: str, restart: int = 0) -> None:
    roster = json.loads((run_dir / "roster.json").read_text())
    assert [n["name"] for n in roster["nodes"]] == NODES
    found = probes(run_dir)
    assert sorted(found) == NODES
    digests = {p["digest"] for p in found.values()}
    assert len(digests) == 1, "every node must agree on the same roster"
    for node, p in found.items():
        env = p["env"]
        assert (env["source"], env["job_id"], env["node"]) == ("slurm", job_id, node)
        assert env["restart_count"] == restart
        assert p["port"] == next(n["port"] for n in roster["nodes"] if n["name"] == node)
    assert len({n["port"] for n in roster["nodes"]} | {roster["store_port"]}) == 5


@pytest.mark.timeout(120)
def test_submit_command_runs_one_agent_per_node(slurm_cluster, tmp_path):
    job_file = write_job(tmp_path, "cli", 1)
    out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "submit", str(job_file), "--wait"],
                         capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = out.stdout.split("submitted job ")[1].split(":")[0]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert (result["job_id"], result["nodes"], result["lost_nodes"], result["exit_code"]) == (
        job_id, NODES, [], 0)
    check_discovery(tmp_path / "cli", job_id)
    assert_one_job_completed(job_id)
    assert not_private(tmp_path / "cli") == {}


@pytest.mark.timeout(120)
def test_sbatch_script_runs_the_same_steps(slurm_cluster, tmp_path):
    job_file = write_job(tmp_path, "sbatch", 1, group_access=True)
    run_dir = tmp_path / "sbatch"
    env = dict(os.environ, OOBLECK_PYTHON=sys.executable,
               OOBLECK_AGENT=f"{sys.executable} -m oobleck_hpc.bootstrap probe --job {job_file} "
                             f"--run-dir {run_dir} --seconds 1")
    out = subprocess.run(["sbatch", "--parsable", "--wait", f"--output={tmp_path}/batch-%j.out",
                          str(ROOT / "slurm" / "train.sbatch"), str(job_file)],
                         capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    job_id = out.stdout.strip().split(";")[0]
    log = (tmp_path / f"batch-{job_id}.out").read_text() if job_id else ""
    assert out.returncode == 0, out.stdout + out.stderr + log
    assert "verdict 0" in log and all(f"'{n}': 0" in log for n in NODES), log
    check_discovery(run_dir, job_id)
    assert_one_job_completed(job_id)
    assert not_private(run_dir, group_access=True) == {}


def _submit_probe(tmp_path: Path, name: str, seconds: float, probe_args: str = ""):
    from oobleck_hpc.launch.slurm import submit

    job = load_job(write_job(tmp_path, name, seconds, probe_args))
    submitted = submit(job)
    run_dir = tmp_path / name
    wait_until(lambda: len(probes(run_dir)) == 4, 60, "all four probes to start")
    return submitted, run_dir


@pytest.mark.timeout(150)
def test_killed_node_leaves_the_job_running_on_the_survivors(slurm_cluster, tmp_path):
    submitted, run_dir = _submit_probe(tmp_path, "kill", seconds=18)
    job_id = submitted.job_id
    subprocess.run([str(slurm_cluster), "kill-node", "n3"], check=True, capture_output=True)
    t_kill = time.time()
    # The controller drops n3 from the job (SlurmdTimeout=5) and the job stays RUNNING.
    wait_until(lambda: job_nodes(job_id) == ["n1", "n2", "n4"], 40, "n3 to leave the job")
    assert submitted.state == "RUNNING"
    result = submitted.result()
    assert result.job_id == job_id and result.restart_count == 0
    assert result.lost_nodes == ["n3"] and result.exit_code == 0
    for node in ("n1", "n2", "n4"):  # the survivors' steps lived on, well past the kill
        assert last_beat(run_dir, node) > t_kill + 8, node
        assert "finished" in probes(run_dir)[node]
    assert last_beat(run_dir, "n3") < t_kill + 0.5
    assert "finished" not in probes(run_dir)["n3"]
    assert_one_job_completed(job_id)  # same job id, never requeued


@pytest.mark.timeout(150)
def test_frozen_node_is_dropped_and_fenced(slurm_cluster, tmp_path):
    submitted, run_dir = _submit_probe(tmp_path, "freeze", seconds=22)
    job_id = submitted.job_id
    # The pre-timeout signal reaches every agent; the exit-code wrapper survives it.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_until(lambda: all("SIGUSR2" in (run_dir / "probe" / f"{n}.beats").read_text()
                           for n in NODES), 10, "every probe to note SIGUSR2")
    subprocess.run([str(slurm_cluster), "freeze-node", "n2"], check=True, capture_output=True)
    try:
        wait_until(lambda: job_nodes(job_id) == ["n1", "n3", "n4"], 40, "n2 to leave the job")
    finally:
        subprocess.run([str(slurm_cluster), "thaw-node", "n2"], check=True, capture_output=True)
    result = submitted.result()
    assert result.lost_nodes == ["n2"] and result.exit_code == 0
    for node in ("n1", "n3", "n4"):
        assert "finished" in probes(run_dir)[node]
        assert probes(run_dir)[node]["signals"] == ["SIGUSR2"]
    # Thawed after it was dropped: Slurm kills the step's processes there (it never finishes).
    # The exit-code wrapper may outlive its agent by a moment and record that kill (137 in a
    # CI run), never an exit 0.
    assert "finished" not in probes(run_dir)["n2"]
    code = run_dir / "exit" / f"{job_id}-r0" / "n2"
    assert not code.exists() or int(code.read_text()) != 0, code.read_text()
    assert_one_job_completed(job_id)


@pytest.mark.timeout(150)
def test_exit_75_requeues_the_same_job_which_runs_again(slurm_cluster, tmp_path):
    submitted, run_dir = _submit_probe(tmp_path, "requeue", seconds=1,
                                       probe_args=" --first-run-exit 75")
    result = submitted.result()  # the second run's (cred_expire=10: it restarts after ~10 s)
    assert (result.job_id, result.restart_count, result.exit_code) == (submitted.job_id, 1, 0)
    first = json.loads((run_dir / f"launch-{submitted.job_id}-r0.json").read_text())
    assert first["exit_code"] == 75 and first["lost_nodes"] == []
    check_discovery(run_dir, submitted.job_id, restart=1)
    assert_one_job_completed(submitted.job_id, restarts=1)


@pytest.mark.timeout(150)
def test_losing_the_batch_node_leaves_the_survivors_to_finish(slurm_cluster, tmp_path):
    # Measured: under --no-kill the job is neither ended nor requeued when the batch script's node
    # dies; the agents elsewhere go on, and the last one to exit records the verdict and requeues
    # the job, whose next run (on one node) publishes it: COMPLETED, with submitit's result.
    from oobleck_hpc.launch.slurm import wait_result

    submitted, run_dir = _submit_probe(tmp_path, "batchloss", seconds=16)
    job_id = submitted.job_id
    subprocess.run([str(slurm_cluster), "kill-node", "n1"], check=True, capture_output=True)
    t_kill = time.time()
    wait_until(lambda: job_nodes(job_id) == ["n2", "n3", "n4"], 40, "n1 to leave the job")
    wait_until(lambda: "Restarts=1" in subprocess.run(["scontrol", "show", "job", job_id],
               capture_output=True, text=True).stdout, 60, "the last agent to requeue the job")
    # The requeued run asks for one node when the last agent's `scontrol update` got in before
    # Slurm ended its step; else for all four (this job has no plan to lower MIN): revive n1.
    subprocess.run([str(slurm_cluster), "up"], check=True, capture_output=True, timeout=120)
    result = wait_result(submitted, run_dir)
    assert (result.job_id, result.restart_count) == (job_id, 0)
    assert result.exit_code == 0 and result.lost_nodes == ["n1"], result
    outcome = json.loads((run_dir / f"launch-{job_id}-r0.json").read_text())
    assert outcome["finished_by"] in ("n2", "n3", "n4") and outcome["exit_code"] == 0
    for node in ("n2", "n3", "n4"):
        assert last_beat(run_dir, node) > t_kill + 8 and "finished" in probes(run_dir)[node]
    rows = assert_one_job_completed(job_id, restarts=None)
    assert rows[-1][1] == "COMPLETED", rows
