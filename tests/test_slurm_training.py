"""Real training (gpt-tiny, oobleck_hpc.train under the node agents) under the real local Slurm
controller of slurm/dev-cluster.sh, compared against a failure-free single-process reference.

Each test submits ONE small 4-node job (1 worker per node, CPU, gloo) and checks:
- through `oobleck-hpc submit --wait` and through `sbatch slurm/train.sbatch`: the job finishes,
  sacct shows one job id, the losses equal the reference within 1e-5;
- a non-batch node killed (`dev-cluster.sh kill-node n3`) at a step observed in the metrics file:
  the job goes on on 3 nodes inside the same allocation (same job id, no requeue in sacct), the
  events show the recovery, every loss (before and after) equals the reference within 1e-5 --
  also on the tiny Llama example (examples/llama-tiny-local.yaml's Hugging Face model);
- a whole node frozen in the commit window (the job's `hang` fault stops n2's processes right
  after its vote of a step was sent, then `freeze-node n2` stops its slurmd and step daemon):
  found by the agents' lease expiry, same outcome.

The workers build the model in float64 (`model.dtype: float64`, as tests/test_recovery.py does
and for the same reason: in fp64 any error in the replayed step, the re-split batch or the moved
optimizer state shows at once) and write their final parameters (`train.save_final_params`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from oobleck_hpc.config import job_from_dict
from oobleck_hpc.records.events import read_events, read_jsonl
from helpers import past_start_retries, start_retries, wait_until
from test_recovery import LLAMA  # the tiny Llama example's model section, in fp64

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30  # gpt-tiny steps take ~0.1 s here: enough of them that a fault lands mid-run
LONG_STEPS = 500  # a replacement job starts and joins ~5 s after a loss; 2 nodes run ~30 steps/s
TOL = 1e-5


def job_dict(run_dir: Path, name: str) -> dict:
    return {
        "name": name,
        "run_dir": str(run_dir),
        "model": {"name": "gpt-tiny", "seed": 0, "dtype": "float64"},
        "train": {"steps": STEPS, "microbatch_size": 2, "global_microbatches": 8, "lr": 1e-3,
                  "warmup_steps": 2, "log_every": 1, "save_final_params": True},
        "cluster": {"launch": "slurm", "nodes": 4, "gpus_per_node": 1, "device": "cpu"},
        "fault_tolerance": {"f": 1, "collective_timeout_s": 5.0, "heartbeat_s": 0.5,
                            "lease_s": 3.0},
        # no measured profile for 1 worker per node: the analytic one (plans differ, losses not)
        "profile": {"library": str(run_dir / "no-profiles"), "analytic": True, "device": "A40"},
        "slurm": {"time_min": 5},
    }


@pytest.fixture(scope="module")
def reference():
    """The failure-free run: the same job in one process, fp64 (the losses of every step)."""
    from oobleck_hpc.engine import reference_run

    return reference_run(job_from_dict(job_dict(Path("/nonexistent"), "reference")), STEPS)


@pytest.fixture(scope="module")
def long_reference():
    """The failure-free run of LONG_STEPS steps (the jobs that grow)."""
    from oobleck_hpc.engine import reference_run

    data = job_dict(Path("/nonexistent"), "reference")
    data["train"]["steps"] = LONG_STEPS
    return reference_run(job_from_dict(data), LONG_STEPS)


def write_job(tmp_path: Path, name: str, **sections: dict) -> tuple[Path, Path]:
    """The job file (`sections`: keys to change per section, e.g. cluster={"nodes": 3}) and its
    run directory."""
    run_dir = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    data = job_dict(run_dir, name)
    for section, values in sections.items():
        data[section].update(values)
    path.write_text(yaml.safe_dump(data))
    return path, run_dir


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def sacct_states(job_id: str) -> list[tuple[str, str]]:
    """(JobID, State) of every record of the job, all its runs (-D: requeues included)."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
                         capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")[:2]) for line in out.splitlines() if line.strip()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def check_run(run_dir: Path, job_id: str, reference, lost: set[str],
              publish_run: bool = False) -> list[dict]:
    """Losses and final parameters equal the reference; one job id, never requeued to train
    again; the events show a recovery from exactly `lost` (none when empty). `publish_run`: the
    batch node was lost, the job came back once only to publish the outcome (COMPLETED)."""
    ref_losses, ref_params = reference
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(ref_losses) + 1)), \
        f"{rows} (logs: {run_dir}/logs)"
    np.testing.assert_allclose([r["loss"] for r in rows], ref_losses, rtol=TOL)
    for layer, params in ref_params.items():
        got = torch.load(run_dir / "final" / f"layer-{layer}.pt")
        for name, value in params.items():
            assert rel(got[name], value) <= TOL, f"layer {layer} {name}: {rel(got[name], value)}"
    # sacct may lag the controller by a moment (slurmdbd): wait for the final state.
    # A node leaving the allocation adds a RESIZING record of the same job id.
    states = wait_until(lambda: (s := sacct_states(job_id)) and s[-1][1] == "COMPLETED" and s,
                        30, f"sacct to show job {job_id} COMPLETED")
    assert {jid for jid, _ in states} == {job_id}, states
    assert {st for _, st in states} <= {"COMPLETED", "RESIZING", "REQUEUED"}, states
    if not publish_run:  # (the survivors may finish before Slurm drops a lost batch host)
        assert (len(states) > 1) == bool(lost), states
        assert "REQUEUED" not in {st for _, st in states}, states
    events = read_events(run_dir / "events.jsonl")
    recovered = [e for e in events if e["kind"] == "recovered"]
    if lost:
        assert recovered, f"no recovery in {run_dir / 'events.jsonl'}"
        assert set().union(*(e["lost"] for e in recovered)) == lost, recovered
        assert rows[-1]["generation"] >= 1
    else:
        assert not recovered and rows[-1]["generation"] == 0
    return events


@pytest.mark.timeout(90, func_only=True)  # setup may wait for the cluster lock
def test_submit_command_trains_to_the_reference(slurm_cluster, tmp_path, reference):
    path, run_dir = write_job(tmp_path, "submit")
    out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "submit", str(path), "--wait"],
                         capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["exit_code"] == 0 and result["lost_nodes"] == []
    assert result["nodes"] == ["n1", "n2", "n3", "n4"]
    check_run(run_dir, result["job_id"], reference, set())


@pytest.mark.timeout(90, func_only=True)  # setup may wait for the cluster lock
def test_sbatch_script_trains_to_the_reference(slurm_cluster, tmp_path, monkeypatch, reference):
    path, run_dir = write_job(tmp_path, "sbatch")
    monkeypatch.setenv("OOBLECK_PYTHON", sys.executable)
    out = subprocess.run(["sbatch", "--parsable", "--nodes=4", "--time=5",
                          f"--output={tmp_path}/sbatch-%j.out", str(ROOT / "slurm/train.sbatch"),
                          str(path)], capture_output=True, text=True, check=True, cwd=tmp_path)
    job_id = out.stdout.strip().split(";")[0]
    try:
        state = wait_until(lambda: (st := _job_state(job_id)) not in (
            "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "") and st, 80,
            f"job {job_id} to end", every_s=0.5)
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True)
        raise
    log = (tmp_path / f"sbatch-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", f"{state}\n{log}"
    check_run(run_dir, job_id, reference, set())


def _job_field(job_id: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    for word in out.stdout.split():
        if word.startswith(f"{field}="):
            return word.removeprefix(f"{field}=")
    return ""


def _job_state(job_id: str) -> str:
    state = _job_field(job_id, "JobState")
    if state:
        return state
    # The controller forgot a finished job (MinJobAge): ask the accounting.
    states = sacct_states(job_id)
    return states[-1][1] if states else ""


def run_with_fault(slurm_cluster, tmp_path, reference, name: str, action: str,
                   node: str | None, hang_at: tuple[int, str] | None = None,
                   then=None, **sections: dict) -> dict:
    """Submit, wait for step 2 to commit, do `dev-cluster.sh ACTION NODE` (node None: the batch
    host; action None: nothing), let the job finish; check it against the reference.
    `hang_at` (step, phase): first the job's own `hang` fault stops NODE's processes exactly
    there (in the job file), and the action follows once it fired. `then(job_id, run_dir)`:
    what to do right after the action. `sections`: changes to the job file (write_job).
    Returns figures (seconds from the fault to the first step committed after it)."""
    from oobleck_hpc.bootstrap import current_job_nodes
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch import submit
    from oobleck_hpc.launch.slurm import wait_result

    path, run_dir = write_job(tmp_path, name, **sections)
    if hang_at is not None:
        data = yaml.safe_load(path.read_text())
        data["faults"] = [{"node": int(node[1:]) - 1, "step": hang_at[0], "phase": hang_at[1],
                           "kind": "hang"}]  # the roster is n1..n4: node index = number - 1
        path.write_text(yaml.safe_dump(data))
    submitted = submit(load_job(path))
    batch_host = node is None
    try:
        wait_until(lambda: len(metrics(run_dir)) >= 2, 60, "step 1 to commit")
        if batch_host:
            node = _job_field(submitted.job_id, "BatchHost")
        t_fault = time.time()
        if hang_at is not None:
            fired = wait_until(lambda: [e for e in read_events(run_dir / "events.jsonl")
                                        if e["kind"] == "fault_injected"], 60, "the hang fault")
            t_fault = fired[0]["t"]
        at = len(metrics(run_dir))
        if action:
            subprocess.run([str(slurm_cluster), action, node], check=True, capture_output=True)
        done_when_fault_landed = len(metrics(run_dir))
        assert done_when_fault_landed < len(reference[0]), "the job finished before the fault landed"
        if then is not None:
            then(submitted.job_id, run_dir)
        try:
            if not batch_host:  # (the survivors may finish before Slurm notices a batch host)
                wait_until(lambda: node not in current_job_nodes(submitted.job_id), 40,
                           f"Slurm to drop {node} from job {submitted.job_id}", every_s=0.5)
        finally:
            if action == "freeze-node":
                subprocess.run([str(slurm_cluster), "thaw-node", node], check=True,
                               capture_output=True)
        result = wait_result(submitted, run_dir)
    except BaseException:  # not after a result: the batch script may still be on its way out
        subprocess.run(["scancel", submitted.job_id], capture_output=True)
        raise
    # The training run's result (a lost batch host: published by the job's next run).
    assert (result.job_id, result.restart_count) == (submitted.job_id, 0)
    assert result.exit_code == 0 and result.lost_nodes == [node], result
    events = check_run(run_dir, submitted.job_id, reference, {node}, publish_run=batch_host)
    after = [r for r in metrics(run_dir) if r["time"] > t_fault and r["generation"] >= 1]
    recovered = [e for e in events if e["kind"] == "recovered"][-1]
    return {"fault_at_step": at, "fault_to_first_step_s": round(after[0]["time"] - t_fault, 2),
            "recovery_s": recovered["seconds"], "joined": recovered["joined"],
            "started_on": result.nodes,
            "last_plan_nodes": [e for e in events if e["kind"] == "plan_chosen"][-1]["nodes"]}


@pytest.mark.timeout(120, func_only=True)  # setup may wait for the cluster lock
def test_killed_node_recovered_in_place(slurm_cluster, tmp_path, reference):
    figures = run_with_fault(slurm_cluster, tmp_path, reference, "kill", "kill-node",
                             "n3")
    print("kill n3:", figures)


# The tiny Llama example (issue 29): its model (a Hugging Face config.json, tied embeddings) in
# fp64 instead of gpt-tiny; 40 steps, so the survivors train well past the kill (after step 2).
LLAMA_STEPS = 40


@pytest.fixture(scope="module")
def llama_reference():
    pytest.importorskip("transformers")
    from oobleck_hpc.engine import reference_run

    data = job_dict(Path("/nonexistent"), "reference")
    data["model"], data["train"]["steps"] = LLAMA, LLAMA_STEPS
    return reference_run(job_from_dict(data), LLAMA_STEPS)


@pytest.mark.timeout(150, func_only=True)  # setup may wait for the cluster lock
def test_killed_node_of_the_tiny_llama_recovered_in_place(slurm_cluster, tmp_path,
                                                         llama_reference):
    figures = run_with_fault(slurm_cluster, tmp_path, llama_reference, "llama", "kill-node",
                             "n3", model=LLAMA, train={"steps": LLAMA_STEPS})
    print("tiny Llama, kill n3:", figures)


@pytest.mark.timeout(120, func_only=True)  # setup may wait for the cluster lock
def test_killed_node_replaced_by_the_spare_of_the_allocation(slurm_cluster, tmp_path, reference):
    """cluster.nodes 3 + spares 1: the job allocates all 4 nodes, n4 waits as a spare; n3 is
    killed and the loss's own recovery swaps n4 in: the job ends on 3 nodes, exact."""
    figures = run_with_fault(slurm_cluster, tmp_path, reference, "spare", "kill-node", "n3",
                             cluster={"nodes": 3, "spares": 1})
    print("kill n3, spare n4:", figures)
    assert figures["started_on"] == ["n1", "n2", "n3", "n4"], figures  # spare included
    assert figures["joined"] == ["n4"] and figures["last_plan_nodes"] == 3, figures


def check_replacement(run_dir: Path, events: list[dict], figures: dict) -> str:
    """One replacement job was submitted, its node n4 joined the running job in the round after
    the loss of n3, and the replacement ended with the job (COMPLETED, no record left)."""
    (submitted,) = [e for e in events if e["kind"] == "replacement_submitted"]
    assert submitted["nodes"] == 1, submitted
    agreed = {e["gen"]: (e["lost"], e["joined"]) for e in events if e["kind"] == "agreement_reached"}
    retried = {e["generation"] for e in start_retries(events) if e["kind"] == "recovered"}
    changes = [v for g, v in sorted(agreed.items()) if g not in retried]  # (helpers.py)
    assert changes == [(["n3"], []), ([], ["n4"])], agreed
    assert figures["last_plan_nodes"] == 3, figures
    job_id = submitted["job_id"]
    states = wait_until(lambda: (s := sacct_states(job_id)) and s[-1][1] not in (
        "PENDING", "RUNNING") and s, 30, f"replacement job {job_id} to end")
    assert states[-1][1] == "COMPLETED", states
    assert not list((run_dir / "replacements").glob("*.json"))
    return job_id


@pytest.mark.timeout(180, func_only=True)  # setup may wait for the cluster lock
def test_replace_submits_a_replacement_job_that_joins(slurm_cluster, tmp_path, long_reference):
    """fault_tolerance.replace on a 3-node job: n3 is killed, the job goes on on 2 nodes and
    submits a 1-node replacement job (n4, the idle node), whose agent joins the running job:
    it ends on 3 nodes, exact, and the replacement job ends with it."""
    figures = run_with_fault(slurm_cluster, tmp_path, long_reference, "replace", "kill-node",
                             "n3", cluster={"nodes": 3}, fault_tolerance={"replace": True},
                             train={"steps": LONG_STEPS})
    events = read_events(tmp_path / "replace" / "events.jsonl")
    figures["replacement"] = check_replacement(tmp_path / "replace", events, figures)
    print("kill n3, replacement job:", figures)


@pytest.mark.timeout(180, func_only=True)  # setup may wait for the cluster lock
def test_grow_by_job_id_adds_a_node_from_a_new_job(slurm_cluster, tmp_path, long_reference):
    """`oobleck-hpc grow JOB_ID --nodes 1 --wait 60` after a 3-node job lost n3: the command
    finds the run by the job's id, submits a replacement job and returns once n4 joined."""
    said = []

    def grow(job_id: str, run_dir: Path) -> None:
        wait_until(lambda: [e for e in read_events(run_dir / "events.jsonl")
                            if e["kind"] == "recovered"], 60, "the recovery from the loss")
        out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "grow", job_id, "--nodes",
                              "1", "--wait", "60"], capture_output=True, text=True, timeout=90)
        said.append(out)

    figures = run_with_fault(slurm_cluster, tmp_path, long_reference, "grow", "kill-node", "n3",
                             then=grow, cluster={"nodes": 3}, train={"steps": LONG_STEPS})
    assert said[0].returncode == 0 and "n4 joined" in said[0].stdout, said[0]
    events = read_events(tmp_path / "grow" / "events.jsonl")
    figures["replacement"] = check_replacement(tmp_path / "grow", events, figures)
    print("kill n3, grow by job id:", figures)


@pytest.mark.timeout(180, func_only=True)  # setup may wait for the cluster lock
def test_a_node_the_administrator_drains_leaves_at_a_step_boundary(slurm_cluster, tmp_path,
                                                                   long_reference):
    """Issue 15: `scontrol update nodename=n3 state=drain` while the job trains. n3's agent sees
    the state (fault_tolerance.drain_poll_s), n3 leaves right after a commit; the others go on
    from that step (no step fails, none is replayed), the batch script gives n3 back to Slurm,
    the job ends exact, COMPLETED, never requeued. Issue 27: n3's agent exits 0 and the run
    trains on for over twice every grace period (an agent's 2 s, the 3 s lease) after it:
    every step 1..N once, the verdict 0 only then."""
    def drain(job_id: str, run_dir: Path) -> None:
        subprocess.run(["scontrol", "update", "nodename=n3", "state=drain",
                        "reason=oobleck test: maintenance"], check=True, capture_output=True)

    try:
        figures = run_with_fault(slurm_cluster, tmp_path, long_reference, "drain", None, "n3",
                                 then=drain, fault_tolerance={"drain_poll_s": 0.5},
                                 train={"steps": LONG_STEPS})
    finally:
        subprocess.run(["scontrol", "update", "nodename=n3", "state=resume"],
                       capture_output=True)
    events = read_events(tmp_path / "drain" / "events.jsonl")
    assert not [e for e in past_start_retries(events)  # (a loaded start: helpers.py)
                if e["kind"] in ("step_failed", "rolled_forward")], events
    asked = [e for e in events if e["kind"] == "drain_requested"]
    assert asked and asked[0]["node"] == "n3" and "slurm" in asked[0]["by"], asked
    agreed = [e for e in events if e["kind"] == "drain_agreed"]
    assert agreed and agreed[0]["nodes"] == ["n3"], agreed
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert recovered[-1]["drained"] == ["n3"] and recovered[-1]["step"] == agreed[0]["step"] + 1
    left = [e for e in events if e["kind"] == "agent_exit" and e["source"] == "n3"]
    assert left and left[0]["code"] == 0, left
    tail = metrics(tmp_path / "drain")[-1]["time"] - left[0]["t"]
    assert tail >= 2 * 3.0, f"the run trained only {tail:.1f} s after n3 left: make it longer"
    print("drain n3:", figures, f"trained {tail:.1f} s after n3 left")


@pytest.mark.timeout(120, func_only=True)  # setup may wait for the cluster lock
def test_frozen_node_recovered_in_place(slurm_cluster, tmp_path, reference):
    """n2 freezes in the commit window: its processes stop right after its vote of step 5 was
    sent (the job's hang fault), then its slurmd and step daemon too (`freeze-node`): a whole
    node frozen. The others decide that step together (commit or replay) and go on exactly."""
    figures = run_with_fault(slurm_cluster, tmp_path, reference, "freeze",
                             "freeze-node", "n2", hang_at=(5, "vote"))
    print("freeze n2 in the commit window:", figures)


@pytest.mark.timeout(120, func_only=True)  # setup may wait for the cluster lock
def test_a_node_whose_processes_froze_is_given_back(slurm_cluster, tmp_path, reference):
    """n2's processes stop in the commit window of step 5 (the job's hang fault) while its slurmd
    lives: Slurm never marks the node, and the agents step would wait for its stopped task
    forever. The survivors agree it away; the batch script kills what the job runs there and
    shrinks the allocation without it (`nodes_released`); the job ends exact, COMPLETED."""
    figures = run_with_fault(slurm_cluster, tmp_path, reference, "giveback", None, "n2",
                             hang_at=(5, "vote"))
    events = read_events(tmp_path / "giveback" / "events.jsonl")
    released = [e for e in events if e["kind"] == "nodes_released"]
    assert [(e["nodes"], e["ok"]) for e in released] == [(["n2"], True)], released
    print("freeze n2's processes, give n2 back:", figures)


@pytest.mark.timeout(180, func_only=True)  # setup may wait for the cluster lock
def test_killed_batch_node_completes(slurm_cluster, tmp_path, reference):
    """The node running the batch script (and submitit's driver) is killed mid-run: the others
    recover in place and finish every step; the job ends COMPLETED (not CANCELLED) and the
    submitter gets the run's result (exit 0, the lost node), not a traceback."""
    figures = run_with_fault(slurm_cluster, tmp_path, reference, "batchkill",
                             "kill-node", None)
    print("kill the batch node:", figures)
