"""Checkpoint fallback and exact resume through `oobleck-hpc run` (real launcher, real workers).

- The guarantee is exceeded in step 5 of a 4-node run (real faults: node1 and node3, the second
  stage of both pipelines, killed at once, the quorum kept): every rank leaves with 75 and the
  job resumes from the checkpoint of step 4; the local requeue role starts it again on the 2
  nodes it has, which gives a different plan; every loss equals the single-process reference
  within 1e-5.
- SIGTERM (preemption) reaches ONE worker: all ranks agree to stop at the same step boundary,
  save that step, exit 75; the requeued job resumes from exactly that step. (SIGUSR2, the
  pre-timeout signal, takes the same path: tests/test_resume_slurm.py sends it through Slurm.)
- The watchdog's contract holds for a real run: run.json, job.lock, heartbeat, exit.json, and
  `oobleck-hpc watch RUN_DIR --once` sees the job finished.
- The run's files are its user's alone (issue 28): every folder under RUN_DIR (checkpoints and
  final state included) is 0700 and every file 0600, and the user `nobody` can neither list
  RUN_DIR nor read its events, roster, secret, a checkpoint shard or the final parameters; a
  drain request file of another user is ignored by the live agent (forced drain case).
- The requeue loop itself (no processes): bounded, node counts from requeue.json, metrics kept.

Two multi-process runs (each two launches of 4 and 3 workers), ~20-30 s each on 2 cores.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import as_nobody, not_private

from oobleck_hpc.errors import EXIT_REQUEUE
from oobleck_hpc.records.runs import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


def write_job(tmp_path: Path, name: str, every_steps: int, steps: int = STEPS,
              faults: list[dict] | None = None, final: bool = False) -> Path:
    """gpt-tiny, 4 nodes x 1 worker; the analytic A40 profile makes the planner pick two 2-node
    pipelines on 4 nodes and a 2-node + a 1-node pipeline on 3 (different templates)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "run_dir": str(tmp_path / name),
        "model": {"name": "gpt-tiny", "seed": 0},
        "data": {"cache_dir": str(ROOT / ".cache" / "oobleck_hpc")},
        "train": {"steps": steps, "microbatch_size": 2, "global_microbatches": 8, "lr": 1e-3,
                  "warmup_steps": 2, "save_final_params": final},
        "cluster": {"launch": "local", "nodes": 4, "gpus_per_node": 1, "device": "cpu"},
        "fault_tolerance": {"f": 1, "collective_timeout_s": 20},
        "profile": {"library": str(tmp_path / "no-profiles"), "analytic": True, "device": "A40"},
        "checkpoint": {"dir": str(tmp_path / name / "ckpt"), "every_steps": every_steps},
        "faults": faults or [],
    }))
    return path


def reference(job_file: Path, steps: int) -> list[float]:
    """The uninterrupted run: the engine's single-process reference over the same batches."""
    import torch

    from oobleck_hpc.config import load_job
    from oobleck_hpc.data import dataset_for
    from oobleck_hpc.engine import Reference
    from oobleck_hpc.models.base import build_model

    job = load_job(job_file)
    torch.set_num_threads(1)
    model = build_model(job.model)
    ref = Reference(job, model, dataset_for(job.data, model, job.source))
    return [ref.step() for _ in range(steps)]


def start_run(job: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "oobleck_hpc", "run", str(job)], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, umask=0o022)  # (the usual login umask)


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started, by process group: the launcher's
    session, and each descendant's group (node agents run in sessions of their own)."""
    groups = {proc.pid}
    for pid in _descendants(proc.pid):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # also pytest-timeout's exception: never leave a job running
        kill_run(proc)
        out, err = proc.communicate()
        pytest.fail(f"the run did not finish in {timeout} s\n{out}\n{err}")
    return proc.returncode, out, err


def job_output(out: str, err: str, run_dir: Path) -> str:
    """What the launcher printed and what the workers wrote to the per-node logs of every
    attempt (RUN_DIR/logs-attempt<k>/, RUN_DIR/logs/), if any."""
    logs = sorted(f for d in run_dir.glob("logs*") if d.is_dir() for f in d.iterdir())
    return "\n".join([out, err, *(f.read_text(errors="replace") for f in logs)])


def losses_by_step(metrics: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["loss"])
    return out


def assert_close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{what}: {got} != {want}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_guarantee_exceeded_falls_back_requeues_on_fewer_nodes_and_resumes_exactly(tmp_path):
    """Real faults beyond the guarantee: the two 2-node pipelines (node0+node1, node2+node3)
    lose their second stage at once (node1 and node3 killed in step 6); half the nodes are
    left, node0 among them, so the survivors keep their quorum, but no replica of the second
    stage's layers is left."""
    shared = tmp_path / "shared"  # (pytest's tmp_path is 0700: let `nobody` in to here)
    shared.mkdir()
    shared.chmod(0o755)
    job = write_job(shared, "exceed", every_steps=2, final=True, faults=[
        {"node": 1, "step": 6, "phase": "backward", "kind": "kill"},
        {"node": 3, "step": 6, "phase": "backward", "kind": "kill"}])
    run_dir = shared / "exceed"
    proc = start_run(job)
    code, out, err = finish(proc, 110)
    assert code == 0, out + err
    reference_losses = reference(job, STEPS)

    # Attempt 0 left with 75 in step 6; it resumed from the latest checkpoint published by
    # then: step 4's, unless the killed nodes had not written their shards of it yet (it is
    # saved in the background; on a loaded machine step 6 can come first: loop round 5 of
    # stop 20), then step 2's.
    assert "requeued: attempt 1 on 2 nodes (alive: node0, node2)" in out, out
    resumed = re.search(r"fell back: .*; the job resumes from step (\d+)", out)
    assert resumed, out
    fallback = int(resumed.group(1))  # rank 0's reading of the published pointer
    assert fallback in (2, 4), fallback
    text = job_output(out, err, run_dir)
    assert f"restored step {fallback} (cursor {fallback * 16})" in text, text
    assert "on 4 nodes x 1 GPU:" in out and "on 2 nodes x 1 GPU:" in out, out
    plans = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        plans.setdefault(row["plan"], []).append(row["step"])
    # The resumed run replays the steps committed on the old plan after the checkpoint (not
    # saved) and records them again. Step 5 is on the old plan's record unless node3 died while
    # node0 still voted on it: then step 5 is committed by rolling forward in the recovery
    # that node1's death ends, whose step never runs, so its row is not written before the
    # fallback (seen in a fresh-clone run); the resumed run records it.
    first, second = list(plans.values())
    assert first in (list(range(1, 5)), list(range(1, 6))), plans
    assert second == list(range(fallback + 1, STEPS + 1)), plans

    # Every loss, on either plan, equals the reference.
    for step, losses in losses_by_step(run_dir / "metrics.jsonl").items():
        for loss in losses:
            assert_close(loss, reference_losses[step - 1], f"step {step}")

    # The checkpoints of the second attempt were published next to the first one's.
    from oobleck_hpc.checkpoint import find_latest

    latest = find_latest(run_dir / "ckpt", quarantine=False).checkpoint
    assert latest is not None and latest.step == 8 and latest.train_state().samples_seen == 8 * 16

    # Private: 0700 / 0600 all through (the run was started with the usual umask 022), and
    # another user of the machine is refused each of the run's files.
    assert not_private(run_dir) == {}
    shard = next(p for p in (run_dir / "ckpt").rglob("*") if p.is_file() and "step-8" in str(p))
    final = next((run_dir / "final").iterdir())
    names = [f"exceed/{p.relative_to(run_dir)}" for p in (
        run_dir / "events.jsonl", run_dir / "roster.json", run_dir / "secret", shard, final)]
    commands = [["ls", "exceed"], *(["cat", name] for name in names)]
    for argv, out in zip(commands, as_nobody(shared, *commands)):
        assert out.returncode != 0 and "Permission denied" in out.stderr, (argv, out)
    job.chmod(0o644)  # (what is refused above is refused by the run's modes, not by the test's)
    assert as_nobody(shared, ["cat", job.name])[0].returncode == 0

    # The watchdog's view of the run: it finished, nothing to restart.
    record = json.loads((run_dir / "run.json").read_text())
    assert record["argv"][-2:] == ["run", str(job)] and record["checkpoint_dir"]
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert json.loads((run_dir / "heartbeat").read_text())["step"] == STEPS
    watch = subprocess.run([sys.executable, "-m", "oobleck_hpc", "watch", str(run_dir), "--once"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert watch.returncode == 0 and "finished" in watch.stderr, watch.stderr


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _workers(pid: int) -> list[int]:
    found = []
    for p in _descendants(pid):
        try:
            if b"oobleck_hpc.train" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except OSError:
            pass
    return sorted(found)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_on_one_worker_checkpoints_at_a_common_step_and_the_job_resumes(tmp_path):
    # No periodic checkpoints: the only one is the one the signal asks for. The signal goes out
    # once the third step is logged; 150 steps (~50 ms each) leave it time to arrive mid-run.
    steps = 150
    job = write_job(tmp_path, "term", every_steps=0, steps=steps)
    run_dir = tmp_path / "term"
    proc = start_run(job)
    try:
        def logged() -> int:
            try:
                return len((run_dir / "metrics.jsonl").read_text().splitlines())
            except OSError:
                return 0

        deadline = time.monotonic() + 90
        while logged() < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        workers = _workers(proc.pid)
        assert workers, "no worker processes found"
        os.kill(workers[-1], signal.SIGTERM)  # one rank only; the others learn it from the vote
    except BaseException:
        kill_run(proc)
        proc.communicate()
        raise
    code, out, err = finish(proc, 100)
    assert code == 0, out + err
    text = job_output(out, err, run_dir)
    assert "received SIGTERM" in text and "requeued: attempt 1 on 4 nodes" in out, text
    stopped = {line.split("] ", 1)[-1].split(":")[0]: int(line.split("stopping at step ")[1].split()[0])
               for line in text.splitlines() if "stopping at step " in line}
    assert len(stopped) == 4 and len(set(stopped.values())) == 1, stopped  # all ranks, one step
    step = next(iter(stopped.values()))
    assert f"restored step {step} (cursor {step * 16})" in text, text
    assert 0 < step < steps, step
    # Nothing replayed, nothing skipped: the requeued job goes on with the exact next batch.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[step - 1]["plan"] == rows[step]["plan"]  # requeued on all 4 nodes again
    want = reference(job, step + 2)
    for s, loss in enumerate(want):
        assert_close(rows[s]["loss"], loss, f"step {s}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stop_signal_to_the_launcher_while_workers_start_stops_the_job_without_a_requeue(
        tmp_path):
    """SIGTERM to `oobleck-hpc run` while its workers still import torch: they die by the signal
    their agents passed on, which is a stop, not a crash (no node fails, nobody is fenced), and
    the launcher that was asked to stop does not start the job again."""
    job = write_job(tmp_path, "stop", every_steps=0)
    run_dir = tmp_path / "stop"
    proc = start_run(job)
    try:
        deadline = time.monotonic() + 60
        while len(_workers(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_workers(proc.pid)) == 4, "the workers did not start"
        os.kill(proc.pid, signal.SIGTERM)
    except BaseException:
        kill_run(proc)
        proc.communicate()
        raise
    code, out, err = finish(proc, 60)
    text = job_output(out, err, run_dir)
    assert code == EXIT_REQUEUE, text
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert "requeued" not in kinds and "not requeued" in err, text
    assert not {"worker_failed", "fenced", "failure_detected"} & set(kinds), kinds
    stopped = [e for e in events if e["kind"] == "worker_exited" and e.get("stopped")]
    assert {e["source"] for e in stopped} == {f"node{i}" for i in range(4)}, events
    assert not (run_dir / "metrics.jsonl").exists() or \
        not (run_dir / "metrics.jsonl").read_text().strip()  # it never trained


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["cli", "signal"])
def test_a_forced_drain_the_others_cannot_absorb_stops_with_a_checkpoint_and_requeues(tmp_path,
                                                                                     how):
    """Issue 15: 2 nodes (f = 0), `oobleck-hpc drain RUN_DIR node0 --force` mid-run (or SIGUSR1
    to node0's agent: a notice to that node alone, a forced drain). node1 alone would not keep
    the agents' quorum (exactly half of the view, without its first node), so the drain is
    refused; forced, every rank stops after the same step with a checkpoint of it (exit 75)
    and the local requeue starts the job again on node1 alone, from exactly that step. Run as
    root, a drain request for node1 that another user (nobody) owns lies there all along: its
    agents ignore it (a `request_ignored` event), else node1 would leave too."""
    steps = 150
    job = write_job(tmp_path, "drain", every_steps=0, steps=steps)
    data = yaml.safe_load(job.read_text())
    data["cluster"]["nodes"], data["fault_tolerance"]["f"] = 2, 0
    job.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "drain"
    proc = start_run(job)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and not (
                (run_dir / "metrics.jsonl").exists()
                and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3):
            time.sleep(0.01)
        foreign = run_dir / "drain" / "node1.json"
        if os.geteuid() == 0:
            foreign.parent.mkdir(mode=0o700, exist_ok=True)
            foreign.write_text(json.dumps({"node": "node1", "force": True, "by": "mallory"}))
            os.chown(foreign, 65534, 65534)
            # node1's agent has seen it (else a forced drain may end the attempt first: the
            # signal's did in one CI run) -- and ignored it: node1 trains on.
            while time.monotonic() < deadline and not any(
                    e["kind"] == "request_ignored" for e in read_jsonl(run_dir / "events.jsonl")):
                time.sleep(0.05)
        if how == "cli":
            asked = subprocess.run([sys.executable, "-m", "oobleck_hpc", "drain", str(run_dir),
                                    "node0", "--force", "--wait", "60"], capture_output=True,
                                   text=True, timeout=90, cwd=ROOT)
        else:
            agents = json.loads((run_dir / "agents.json").read_text())
            os.kill(agents["node0"], signal.SIGUSR1)
    except BaseException:
        kill_run(proc)
        proc.communicate()
        raise
    code, out, err = finish(proc, 100)
    if how == "cli":
        assert asked.returncode == 0 and "drain of node0 refused" in asked.stdout, asked.stdout
    from oobleck_hpc.records.events import read_events

    events = read_events(run_dir / "events.jsonl")
    asked = [(e["node"], e["force"], e["by"]) for e in events if e["kind"] == "drain_requested"]
    assert asked == [("node0", True, getpass.getuser() if how == "cli" else "SIGUSR1")], asked
    if os.geteuid() == 0:
        ignored = {(e["source"], e["request"], e["path"], e["reason"])
                   for e in events if e["kind"] == "request_ignored"}
        assert ignored == {("node1", "drain", str(foreign), "is owned by uid 65534, not by the "
                            "job's user (uid 0)")}, ignored
    assert code == 0, out + err
    stopped = re.search(r"stopping for a requeue after step (\d+): drain of node0 forced", out)
    assert stopped and "requeued: attempt 1 on 1 node (alive: node1)" in out, out
    step = int(stopped.group(1))
    assert 0 < step < steps, step
    text = job_output(out, err, run_dir)
    assert f"restored step {step} (cursor {step * 16})" in text, text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # nothing lost or replayed
    want = reference(job, step + 2)
    for s, loss in enumerate(want):
        assert_close(rows[s]["loss"], loss, f"step {s}")


# ----------------------------------------------------------------------------- the requeue loop


def test_requeue_loop_is_bounded_follows_the_alive_nodes_and_keeps_metrics(tmp_path, monkeypatch,
                                                                          caplog):
    from oobleck_hpc.launch.requeue import run_with_requeue
    from oobleck_hpc.records.runs import attempt as restart_count

    monkeypatch.delenv("OOBLECK_ATTEMPT", raising=False)
    monkeypatch.delenv("OOBLECK_RESTART_COUNT", raising=False)
    metrics = tmp_path / "metrics.jsonl"
    seen = []

    def launch(attempt):
        seen.append((attempt.index, attempt.nodes, os.environ["OOBLECK_ATTEMPT"], restart_count()))
        with open(metrics, "a") as f:  # as every attempt's writer does: it appends
            f.write(f"attempt {attempt.index}\n")
        if attempt.index == 0:
            (tmp_path / "requeue.json").write_text(json.dumps({"reason": "r", "nodes": ["a", "b"]}))
            return EXIT_REQUEUE
        return EXIT_REQUEUE if attempt.index == 1 else 0

    from oobleck_hpc.records.events import EventLog, read_events

    code, attempts = run_with_requeue(launch, nodes=4, run_dir=tmp_path, max_requeues=3,
                                      events=EventLog(tmp_path / "events.jsonl", "launcher"))
    assert code == 0 and [a.code for a in attempts] == [75, 75, 0]
    assert [s[1] for s in seen] == [4, 2, 2]  # attempt 1 left no record: same nodes again
    assert [s[3] for s in seen] == [0, 1, 2]
    assert [s[2].rsplit(".", 1)[1] for s in seen] == ["r0", "r1", "r2"]
    assert len({s[2].rsplit(".", 1)[0] for s in seen}) == 1
    assert metrics.read_text() == "attempt 0\nattempt 1\nattempt 2\n"
    requeued = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "requeued"]
    assert [(e["next_attempt"], e["nodes"]) for e in requeued] == [(1, 2), (2, 2)]
    assert "OOBLECK_ATTEMPT" not in os.environ  # restored after the loop

    code, attempts = run_with_requeue(lambda a: EXIT_REQUEUE, nodes=2, run_dir=tmp_path,
                                      max_requeues=1)
    assert code == EXIT_REQUEUE and len(attempts) == 2  # gave up after one requeue
    assert "giving up after 1 requeues" in caplog.text  # a warning (oobleck_hpc.launch.requeue)
    for bad_input in (0, 2, 3):
        code, attempts = run_with_requeue(lambda a, c=bad_input: c, nodes=2, run_dir=tmp_path)
        assert code == bad_input and len(attempts) == 1  # never requeued

    def stopped(attempt):
        attempt.stopped = True  # a stop signal reached the launcher: not started again
        return EXIT_REQUEUE

    code, attempts = run_with_requeue(stopped, nodes=2, run_dir=tmp_path)
    assert code == EXIT_REQUEUE and len(attempts) == 1
    with pytest.raises(ValueError):
        run_with_requeue(lambda a: 0, nodes=1, run_dir=tmp_path, max_requeues=-1)


def test_restart_count_takes_the_largest_source(monkeypatch):
    from oobleck_hpc.records.runs import attempt as restart_count

    for key in ("SLURM_RESTART_COUNT", "OOBLECK_REQUEUE_COUNT", "OOBLECK_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("OOBLECK_RESTART_COUNT", "0")  # what the node environment always sets
    monkeypatch.setenv("OOBLECK_REQUEUE_COUNT", "2")
    assert restart_count() == 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert restart_count() == 3


def test_a_fallback_from_a_recovery_records_its_survivors_for_the_requeue(tmp_path):
    """A GuaranteeExceeded raised by a recovery names the nodes still alive (its `survivors`):
    rank 0's requeue.json and the fallback event carry them, so the requeue starts on them."""
    from oobleck_hpc.config import load_job
    from oobleck_hpc.records.events import FALLBACK, EventLog, read_events
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.checkpoint.resume import Resume
    from oobleck_hpc.records.runs import REQUEUE_RECORD, read_requeue_record

    job = load_job(write_job(tmp_path, "survivors", every_steps=0))
    run_dir = tmp_path / "run"
    events = EventLog(run_dir / "events.jsonl", "node0/0")
    error = GuaranteeExceeded("no replica of layer 3", survivors=("node0", "node2"))
    assert Resume.unstarted(job, run_dir, "cpu", events).fallback(error) == EXIT_REQUEUE
    record = read_requeue_record(run_dir)
    assert (record["reason"], record["nodes"]) == ("no replica of layer 3", ["node0", "node2"])
    [fallback] = [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == FALLBACK]
    assert fallback["nodes"] == ["node0", "node2"]

    (run_dir / REQUEUE_RECORD).unlink()
    assert Resume.unstarted(job, run_dir, "cpu").fallback(GuaranteeExceeded("planner")) == 75
    assert read_requeue_record(run_dir)["nodes"] is None  # the planner's: no survivors known
