"""A Slurm fleet's pieces that need no cluster: which node of the allocation is free
(launch/fleet_pool.py, with the controller's answer given), `fleet submit --dry-run`, and the
errors of its commands outside an allocation. The fleet in a real allocation:
tests/test_slurm_fleet.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from oobleck_hpc import cli
from oobleck_hpc.files import write_json
from oobleck_hpc.launch.fleet_pool import SlurmPool
from oobleck_hpc.launch.slurm_steps import STEPS_FILE

ALLOCATION = ["n1", "n2", "n3", "n4"]


@pytest.fixture
def allocation(monkeypatch):
    """The controller's answer to "which nodes does the job hold now" (a list to change)."""
    nodes = list(ALLOCATION)
    monkeypatch.setattr("oobleck_hpc.bootstrap.environment.current_job_nodes",
                        lambda job_id: list(nodes))
    return nodes


def test_a_node_is_free_once_its_step_ended_or_its_job_did(tmp_path, allocation):
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for d in dirs.values():
        d.mkdir()
    running = {"a": True, "b": True}
    pool = SlurmPool("7")

    def free() -> list[str]:
        return pool.free(dirs, running.__getitem__)

    assert pool.take("a", 2, "start-0", dirs, running.__getitem__) == ["n1", "n2"]
    assert pool.take("b", 2, "start-0", dirs, running.__getitem__) == ["n3", "n4"]
    assert free() == []
    # the same action again (a manager that took over): the same nodes, nothing more taken
    assert pool.take("a", 2, "start-0", dirs, running.__getitem__, timeout_s=0) == ["n1", "n2"]
    t = time.time()
    # b's step on n4 ended (drained): free; a step that ended before the node was given is not
    write_json(dirs["b"] / STEPS_FILE, {"n4": {"started": t, "ended": t + 1, "code": 0}})
    write_json(dirs["a"] / STEPS_FILE, {"n2": {"started": t - 100, "ended": t - 99, "code": 0}})
    assert free() == ["n4"]
    assert pool.take("a", 1, "fleet-3", dirs, running.__getitem__) == ["n4"]
    assert pool.held["n4"]["job"] == "a" and free() == []
    with pytest.raises(TimeoutError, match="1 free nodes of allocation 7 for b"):
        pool.take("b", 1, "fleet-4", dirs, running.__getitem__, timeout_s=0)
    running["b"] = False  # b's launcher ended: n3 is free; a dead node is never free
    allocation.remove("n3")
    assert free() == []
    allocation.append("n3")
    assert free() == ["n3"]


def write_fleet(tmp_path: Path) -> Path:
    job = {"name": "tiny", "model": {"name": "gpt-tiny"}, "cluster": {"nodes": 2},
           "run_dir": str(tmp_path / "unused")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"name": "two", "pool": {"nodes": 4},
                                    "slurm": {"time_min": 30, "partition": "gpu"},
                                    "jobs": [{"job": "job.yaml", "name": "a", "weight": 2},
                                             {"job": "job.yaml", "name": "b"}]}))
    return path


def test_fleet_submit_dry_run_asks_for_the_pool_in_one_allocation(tmp_path, capsys):
    path = write_fleet(tmp_path)
    run_dir = tmp_path / "fleet-run"
    assert cli.main(["fleet", "submit", str(path), "--run-dir", str(run_dir), "--dry-run"]) == 0
    shown = json.loads(capsys.readouterr().out)
    sbatch = shown["sbatch"]
    assert (sbatch["nodes"], sbatch["time"], sbatch["partition"]) == (4, 30, "gpu")
    extra = sbatch["additional_parameters"]
    assert extra["no-kill"] and "requeue" not in extra and extra["signal"] == "B:USR2@90"
    assert shown["manager"][1:5] == ["-m", "oobleck_hpc", "fleet", "run"]
    assert shown["manager"][-3:] == ["--run-dir", str(run_dir), "--slurm"]
    assert not run_dir.exists()  # (nothing written by a dry run)


def test_slurm_fleet_commands_say_where_they_run(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = write_fleet(tmp_path)
    assert cli.main(["fleet", "run", str(path), "--run-dir", str(tmp_path / "r"), "--slurm"]) == 2
    assert "--slurm" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "job.yaml"), "--on-nodes", ","]) == 2
    assert "--on-nodes" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text(path.read_text().replace("time_min: 30", "time_min: 0"))
    assert cli.main(["fleet", "submit", str(tmp_path / "bad.yaml"), "--dry-run"]) == 2
    assert "slurm.time_min" in capsys.readouterr().err
