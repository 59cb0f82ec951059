"""Watchdog: a real job process that writes progress and checkpoints, then dies or hangs, is brought
back from its latest checkpoint; a live job is never started twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oobleck_hpc.operate.liveness import JobLock, WatchError, lock_holder, write_run_record
from oobleck_hpc.operate.watch import Observation, Watchdog, watchdog_for

ROOT = Path(__file__).resolve().parents[1]

# A fake-but-real job: holds the job lock, checkpoints every step with the real Checkpointer,
# resumes from the latest checkpoint, and on its first run dies (SIGKILL) or hangs after step 3.
JOB = textwrap.dedent("""
    import os, sys, time, signal
    from oobleck_hpc.operate.liveness import JobLock, beat, record_exit

    run_dir, ckpt_dir, total, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with JobLock(run_dir):  # first thing, before the slow imports
        if mode == "bad":
            record_exit(run_dir, 2, "bad config"); sys.exit(2)
        import torch
        from oobleck_hpc.checkpoint import Checkpointer, TrainState, find_latest
        latest = find_latest(ckpt_dir).checkpoint
        start = latest.step if latest else 0
        if latest:
            assert latest.layer(0)["param/w"].item() == start  # resumes from what it saved
        with open(os.path.join(run_dir, "starts.txt"), "a") as f:
            f.write(f"{start} {os.environ.get('OOBLECK_ATTEMPT', '-')}\\n")
        cp = Checkpointer(ckpt_dir, rank=0, num_layers=1, keep=2)
        for step in range(start, total):
            time.sleep(0.05)
            cp.save_sync(step + 1, {0: {"param/w": torch.tensor(float(step + 1))}},
                         TrainState(step=step + 1))
            beat(run_dir, step + 1)
            if start == 0 and step + 1 == 3:
                if mode == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "hang":
                    time.sleep(1000)
            if mode == "slow":
                time.sleep(0.5)
        record_exit(run_dir, 0, "done")
""")


# `oobleck-hpc watch ...` through cli.main, with only this command registered (the test does
# not depend on the other commands' modules).
WATCH_CLI = textwrap.dedent("""
    import sys
    from oobleck_hpc import cli
    cli.COMMAND_MODULES[:] = ["oobleck_hpc.operate.cli"]
    sys.exit(cli.main(["watch", *sys.argv[1:]]))
""")


def _setup(tmp_path: Path, mode: str, total: int = 6) -> tuple[Path, list[str]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(script), str(run_dir), str(tmp_path / "ckpt"), str(total), mode]
    write_run_record(run_dir, argv, cwd=str(ROOT), checkpoint_dir=str(tmp_path / "ckpt"))
    return run_dir, argv


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, start_new_session=True)


def _starts(run_dir: Path) -> list[str]:
    return (run_dir / "starts.txt").read_text().split("\n")[:-1]


def _kill(p: subprocess.Popen | None) -> None:
    if p is not None and p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.timeout(90)
def test_restarts_a_job_that_died_from_its_latest_checkpoint(tmp_path):
    run_dir, argv = _setup(tmp_path, "die")
    job = _start(argv)
    dog = Watchdog(run_dir, interval_s=0.1, stall_s=60, startup_s=1.0, log=lambda m: None)
    try:
        assert dog.loop() == 0
    finally:
        _kill(job)
        _kill(dog._child)
    assert job.wait() == -signal.SIGKILL
    assert dog.restarts == 1
    assert _starts(run_dir) == ["0 -", "3 watch-1"]
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert json.loads((run_dir / "heartbeat").read_text())["step"] == 6


@pytest.mark.timeout(90)
def test_stops_and_restarts_a_job_that_hangs(tmp_path):
    run_dir, argv = _setup(tmp_path, "hang")
    job = _start(argv)
    msgs: list[str] = []
    # stall_s above the job's start-up (import torch on a busy machine): only the hang trips it.
    dog = Watchdog(run_dir, interval_s=0.1, stall_s=5.0, grace_s=1.0, startup_s=1.0, log=msgs.append)
    try:
        assert dog.loop() == 0
    finally:
        _kill(job)
        _kill(dog._child)
    assert job.wait() in (-signal.SIGTERM, -signal.SIGKILL)
    assert _starts(run_dir) == ["0 -", "3 watch-1"]
    assert any("has not advanced" in m for m in msgs), msgs


@pytest.mark.timeout(90)
def test_never_starts_a_second_copy_of_a_live_job(tmp_path):
    run_dir, argv = _setup(tmp_path, "slow", total=8)
    job = _start(argv)
    dog = Watchdog(run_dir, interval_s=0.1, stall_s=60, startup_s=1.0, log=lambda m: None)
    try:
        deadline = time.monotonic() + 30
        while lock_holder(run_dir / "job.lock") is None:  # wait until it runs
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert f"pid={job.pid}" in lock_holder(run_dir / "job.lock")
        for _ in range(5):
            assert dog.step().action == "wait"
        assert dog.restarts == 0 and dog._child is None
        # Started by hand while it runs: the second copy refuses.
        second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "already running" in second.stderr
        # A second watchdog on the same run dir refuses too.
        with open(run_dir / "watch.lock", "w"):
            pass
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import time
            from oobleck_hpc.operate.watch import _WatchLock
            from pathlib import Path
            with _WatchLock(Path({str(run_dir)!r})):
                print("locked", flush=True); time.sleep(30)
        """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        other = subprocess.run([sys.executable, "-c", WATCH_CLI, str(run_dir), "--once"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        holder.kill()
        holder.wait()
        assert other.returncode != 0 and "another watchdog" in other.stderr, other.stderr
        assert job.wait(timeout=60) == 0
        assert dog.step().action == "finished"
    finally:
        _kill(job)
    assert _starts(run_dir) == ["0 -"]


@pytest.mark.timeout(60)
def test_a_job_that_refuses_is_not_restarted(tmp_path):
    run_dir, argv = _setup(tmp_path, "bad")
    assert subprocess.run(argv, cwd=ROOT).returncode == 2
    dog = Watchdog(run_dir, interval_s=0.1, startup_s=1.0, log=lambda m: None)
    assert dog.loop() == 3 and dog.restarts == 0


def test_gives_up_after_max_restarts(tmp_path):
    run_dir = tmp_path / "run"
    write_run_record(run_dir, [sys.executable, "-c", "import sys; sys.exit(75)"], cwd=str(ROOT))
    dog = Watchdog(run_dir, interval_s=0.05, max_restarts=2, startup_s=0.2, log=lambda m: None)
    assert dog.loop() == 3 and dog.restarts == 2


def test_job_lock_refuses_while_held_and_frees_on_release(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from oobleck_hpc.operate.liveness import JobLock
        with JobLock({str(tmp_path)!r}):
            print("locked", flush=True); time.sleep(30)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(WatchError, match="already running"):
            JobLock(tmp_path, wait_s=0.2).acquire()
    finally:
        holder.kill()
        holder.wait()
    with JobLock(tmp_path):  # the kernel released the dead holder's lock
        pass
    assert lock_holder(tmp_path / "job.lock") is None


class FakeSlurm:
    """Answers squeue / sacct / scontrol / sbatch from a scripted state."""

    def __init__(self, states):
        self.states = list(states)  # per check: squeue state or ("", "FAILED|1:0")
        self.calls = []

    def __call__(self, argv, **kw):
        self.calls.append(argv)
        out = ""
        if argv[0] == "squeue":
            st = self.states[0]
            out = st if isinstance(st, str) else ""
            if isinstance(st, str):
                self.states.pop(0)
        elif argv[0] == "sacct":
            out = self.states.pop(0)[1]
        elif argv[:3] == ["scontrol", "show", "job"]:
            out = "JobId=41 JobName=x Command=/home/u/job.sbatch WorkDir=/home/u"
        elif argv[0] == "sbatch":
            out = "42\n"
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_slurm_form_resubmits_a_failed_job_and_leaves_a_completed_one():
    slurm = FakeSlurm(["RUNNING", ("", "NODE_FAIL|0:0"), "PENDING", ("", "COMPLETED|0:0")])
    dog = watchdog_for("41", run=slurm, log=lambda m: None)
    assert dog.step().action == "wait"
    assert dog.step().action == "restart"
    assert ["sbatch", "--parsable", "--chdir", "/home/u", "/home/u/job.sbatch"] in slurm.calls
    assert dog.job_id == "42"
    assert dog.step().action == "wait"
    assert dog.step().action == "finished"


def test_slurm_form_leaves_cancelled_and_bad_input_jobs_alone():
    for acct in ("CANCELLED by 1000|0:15", "FAILED|2:0"):
        dog = watchdog_for("41", run=FakeSlurm([("", acct)]), log=lambda m: None)
        assert dog.step().action == "refused"


def test_decide_counts_stall_from_the_last_change_of_step(tmp_path):
    now = [0.0]
    dog = Watchdog(tmp_path, stall_s=10, clock=lambda: now[0], log=lambda m: None)
    assert dog.decide(Observation(True, step=None, pid=1)).action == "wait"
    now[0] = 9
    assert dog.decide(Observation(True, step=None, pid=1)).action == "wait"
    assert dog.decide(Observation(True, step=1, pid=1)).action == "wait"  # progress resets
    now[0] = 18
    assert dog.decide(Observation(True, step=1, pid=1)).action == "wait"
    now[0] = 19.5
    assert dog.decide(Observation(True, step=1, pid=1)).action == "stop-and-restart"


def test_watch_target_errors_are_clear(tmp_path):
    with pytest.raises(WatchError, match="neither a run directory nor a Slurm job id"):
        watchdog_for(str(tmp_path / "nope"))
    with pytest.raises(WatchError, match="without run.json"):
        watchdog_for(str(tmp_path))
