"""The local launcher's end of a job (oobleck_hpc/launch/local.py): its exit-code rule, a job
file rejected before any process starts, never waiting forever on a stopped node, and a node
that leaves cleanly mid-run handled as a loss (the others finish every step).

Multi-process tests have a hard timeout and kill every process they started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from oobleck_hpc.launch.local import LocalRun, job_exit_code

ROOT = Path(__file__).resolve().parents[1]
KILLED, SIGKILLED = None, -9


def _finished(run_dir: Path, steps: int = 3) -> None:
    """The record of a run whose last step committed (what rank 0 writes: oobleck_hpc/records/runs.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "kind": "run_finished", "steps": steps,
                            "total": steps}) + "\n")


@pytest.mark.parametrize("finished, codes, want", [
    (True, {"a": 0, "b": 0}, 0),                      # everyone finished
    (True, {"a": 0, "b": 3, "c": SIGKILLED}, 0),      # others lost on the way
    (True, {"a": 3, "b": 0, "c": KILLED}, 0),         # a node killed after the run finished
    (False, {"a": 0, "b": KILLED}, 3),                # a drained node's 0 is no success
    (False, {"a": 0, "b": 0}, 3),                     # nor every node's, without the record
    (False, {"a": 0, "b": 75}, 75),                   # drained, then the others fell back
    (False, {"a": 2, "b": 2, "c": 3}, 2),             # bad input: never requeue
    (False, {"a": 2, "b": 75}, 2),
    (False, {"a": 75, "b": 3, "c": SIGKILLED}, 75),   # no quorum / fallback: requeue
    (False, {"a": 3, "b": SIGKILLED, "c": KILLED}, 3),
    (False, {"a": 1}, 3),                             # an unknown code is no success
])
def test_job_exit_code_is_the_runs_verdict(tmp_path, finished, codes, want):
    if finished:
        _finished(tmp_path)
    assert job_exit_code(codes, tmp_path) == want


class _Agents:
    """What LocalRun._wait reads: `procs`, node -> Popen, and their exit codes (`poll`)."""

    def __init__(self, procs: dict[str, subprocess.Popen]):
        self.procs = procs

    def poll(self) -> dict[str, int | None]:
        return {m: p.poll() for m, p in self.procs.items()}

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=10)


def _wait_for(procs: dict[str, subprocess.Popen], kill_grace_s: float, run_dir: Path) -> int:
    from oobleck_hpc.config import JobConfig

    run = LocalRun(JobConfig(), Path("job.yaml"), run_dir, kill_grace_s=kill_grace_s)
    run.agents = _Agents(procs)
    try:
        return run._wait()
    finally:
        run.agents.cleanup()


def _stopped(p: subprocess.Popen) -> subprocess.Popen:
    from oobleck_hpc.control.workers import process_state

    p.send_signal(signal.SIGSTOP)
    while process_state(p.pid) not in ("T", "t"):
        time.sleep(0.001)
    return p


def _exits(code: int, after_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({after_s}); "
                             f"raise SystemExit({code})"])


@pytest.mark.timeout(60)
def test_launcher_never_waits_on_a_stopped_node(tmp_path):
    """A stopped node that outlives the others ends the wait (no grace period applies: a long
    one would hang this test into its timeout); its code counts as a lost node."""
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    _finished(tmp_path / "a")
    procs = {"node0": _exits(0), "node1": _stopped(subprocess.Popen(sleep))}
    procs["node0"].wait(timeout=30)
    assert _wait_for(procs, 600, tmp_path / "a") == 0
    procs = {"node0": _exits(75), "node1": _stopped(subprocess.Popen(sleep))}
    assert _wait_for(procs, 600, tmp_path / "b") == 75
    # A running (not stopped) node after the run finished: waited for kill_grace_s, then killed.
    procs = {"node0": _exits(0), "node1": subprocess.Popen(sleep)}
    assert _wait_for(procs, 0.5, tmp_path / "a") == 0
    # Nothing finished yet and nothing stopped: the launcher waits for the agents' own verdict.
    procs = {"node0": _exits(3), "node1": _exits(75, after_s=1.0)}
    assert _wait_for(procs, 0.0, tmp_path / "c") == 75


@pytest.mark.timeout(60)
def test_a_node_that_exits_0_early_ends_nothing(tmp_path):
    """Issue 27: a drained node's agent exits 0 while the others train on. The launcher starts
    no grace period for it (it once killed every survivor kill_grace_s later and reported the
    run finished); it waits for the others, and the verdict is theirs: here they fall back."""
    procs = {"node0": _exits(0), "node1": _exits(75, after_s=1.5),
             "node2": _exits(75, after_s=1.5)}
    assert _wait_for(procs, 0.2, tmp_path / "early") == 75
    assert [p.returncode for p in procs.values()] == [0, 75, 75]  # nobody was killed
    # The others finish the run: its record makes it 0 (and a late node is given the grace).
    procs = {"node0": _exits(0), "node1": _exits(0, after_s=1.5)}
    threading.Timer(1.0, _finished, (tmp_path / "late",)).start()
    assert _wait_for(procs, 5.0, tmp_path / "late") == 0
    assert [p.returncode for p in procs.values()] == [0, 0]


@pytest.mark.timeout(60)
def test_run_rejects_an_unknown_model_before_any_process_starts(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text((ROOT / "examples" / "gpt-tiny-local.yaml").read_text()
                   .replace("name: gpt-tiny\n", "name: gpt-nonexistent\n")
                   + f"run_dir: {tmp_path / 'run'}\n")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "oobleck_hpc", "run", str(job)], cwd=ROOT,
                       capture_output=True, text=True, timeout=50)
    print(f"\n[figures] unknown model rejected in {time.monotonic() - t:.2f} s")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{job}: key 'model.name': value 'gpt-nonexistent'" in r.stderr, r.stderr
    assert "Fix: use one of: gpt-tiny" in r.stderr
    assert not (tmp_path / "run").exists()  # no agent, no worker, not even a run directory


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_that_leaves_cleanly_mid_run_is_a_loss_and_the_others_finish(tmp_path):
    """4 nodes x 1 worker; node2 leaves cleanly (the `exit` fault) in step 4's backward pass:
    its peers recover in place at once, every step is committed, every loss equals the
    single-process reference, the job exits 0 and node2's agent 3 (it did not finish)."""
    from test_resume import finish, job_output, losses_by_step, reference, start_run, write_job

    steps = 8
    job = write_job(tmp_path, "leave", every_steps=0, steps=steps)
    text = job.read_text() + "faults:\n- {node: 2, step: 4, phase: backward, kind: exit}\n"
    job.write_text(text)
    run_dir = tmp_path / "leave"
    code, out, err = finish(start_run(job), 180)
    logs = job_output(out, err, run_dir)
    assert code == 0, logs
    got = losses_by_step(run_dir / "metrics.jsonl")
    assert sorted(got) == list(range(1, steps + 1)), logs
    want = reference(job, steps)
    for step, losses in got.items():
        for loss in losses:
            assert abs(loss - want[step - 1]) <= 1e-5 * max(1.0, abs(want[step - 1])), (step, loss)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["kind"] == "agreement_reached" and e["lost"] == ["node2"]]
    assert lost, logs  # seen in-band by its pipeline peer, or from its BYE: either is a loss
    assert not [e for e in events if e["kind"] == "retry_round"], logs  # nothing else failed
    exits = {e["source"]: e["code"] for e in events if e["kind"] in ("agent_exit",)}
    assert exits.get("node2") == 3, exits


AGENT_PRIORITY_PROBE = """
import json, os, subprocess, sys, threading
from oobleck_hpc.control.workers import raise_agent_priority, usual_policy_for_children

raised = raise_agent_priority()
seen = {}
t = threading.Thread(target=lambda: seen.update(thread=os.sched_getscheduler(0)))
t.start(); t.join()
child = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
with usual_policy_for_children():
    seen["worker"] = int(subprocess.run(child, capture_output=True, text=True).stdout)
seen["after"] = os.sched_getscheduler(0)
print(json.dumps({"raised": raised, **seen}))
"""


@pytest.mark.timeout(60)
def test_an_agent_runs_real_time_and_the_processes_it_starts_as_usual():
    """The agent's threads run SCHED_RR (control/workers.py, `raise_agent_priority`); its
    workers run as usual."""
    import os

    out = subprocess.run([sys.executable, "-c", AGENT_PRIORITY_PROBE], capture_output=True,
                         text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    if not seen["raised"]:
        pytest.skip("SCHED_RR is not allowed here (not root, no RLIMIT_RTPRIO)")
    # The agent's threads inherit it; the worker does not; the agent keeps it after the start
    # (without the reset-on-fork flag: its next threads inherit it too).
    assert seen == {"raised": True, "thread": os.SCHED_RR, "worker": os.SCHED_OTHER,
                    "after": os.SCHED_RR}, seen
