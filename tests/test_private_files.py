"""A run's files are its user's alone (issue 28; oobleck_hpc/records/runs.py, "Private").

- `runs.begin` makes RUN_DIR 0700 (0750 with the job's `group_access`) even when it was made
  0755 before, and what it writes is 0600 (0640); the secret is 0600 either way; the caller's
  umask is left as it was.
- `runs.private_files` is umask 077 (027 with group_access), restored after; `drain` and `grow`
  run under it; `bootstrap umask JOB` tells slurm/train.sbatch which one a job wants.
- A request file (drain, grow) is read only when the job's user owns it (`runs.read_own`): a
  link, a FIFO or another user's file is ignored -- the agent's drain watch and the local
  launcher's grow requests -- each reported once (a `request_ignored` event, a console line).

A real run's files (modes, and reads as the user `nobody`) are checked where a run already
happens: tests/test_resume.py (the fallback run: checkpoints, final state, logs, roster, events,
secret) and its forced drain (another user's drain request, ignored by a live agent).
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from helpers import not_private, wait_until

from oobleck_hpc.records import runs

NOBODY = 65534


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to give a file to another user (chown)")


@pytest.fixture
def umask_022():
    """The usual login umask for the test, and the test's own back after it."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize("group_access", [False, True])
def test_begin_makes_run_dir_private_and_leaves_the_callers_umask(tmp_path, umask_022,
                                                                  group_access):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # 0755: as an earlier run, or the user, made it
    runs.begin(run_dir, "run-1", group_access=group_access)
    runs.begin(tmp_path / "new" / "run", "run-1", group_access=group_access)
    assert os.umask(0o022) == 0o022, "begin changed its caller's umask"
    assert {p.name for p in run_dir.iterdir()} == {"run-id", "secret"}
    assert not_private(run_dir, group_access) == {}
    assert not_private(tmp_path / "new", group_access) == {}
    assert stat.S_IMODE((run_dir / "secret").stat().st_mode) == 0o600


def test_private_files_umask_and_the_slurm_scripts_umask(tmp_path, umask_022, capsys):
    from oobleck_hpc.bootstrap.__main__ import main as bootstrap
    from oobleck_hpc.files import write_json

    for group_access in (False, True):
        folder = tmp_path / f"group-{group_access}"
        with runs.private_files(group_access):
            assert runs.current_umask() == (0o027 if group_access else 0o077)
            (folder / "ckpt").mkdir(parents=True)
            write_json(folder / "ckpt" / "MANIFEST.json", {})
        assert runs.current_umask() == 0o022
        assert not_private(folder, group_access) == {}
        job = tmp_path / f"job-{group_access}.yaml"
        job.write_text(f"name: x\ngroup_access: {str(group_access).lower()}\n")
        assert bootstrap(["umask", str(job)]) == 0
        assert capsys.readouterr().out.strip() == ("027" if group_access else "077")


def test_group_access_is_a_checked_job_key():
    from oobleck_hpc.config import job_from_dict
    from oobleck_hpc.errors import ConfigError

    assert job_from_dict({}).group_access is False
    assert job_from_dict({"group_access": True}).group_access is True
    with pytest.raises(ConfigError) as e:
        job_from_dict({"group_access": "team"}, source="job.yaml")
    assert str(e.value) == ("job.yaml: key 'group_access': value 'team' is not true/false. "
                            "Fix: write true or false")


def test_drain_and_grow_create_their_requests_privately(tmp_path, umask_022):
    """`oobleck-hpc drain` and `grow` run under runs.private_files (launch/cli.py); `run`
    under the job's own group_access (checked with a real run: tests/test_resume.py)."""
    import argparse

    from oobleck_hpc.cli import build_parser
    from oobleck_hpc.operate.cli import _private

    def command(args: argparse.Namespace) -> int:
        (tmp_path / "made").mkdir()
        (tmp_path / "made" / "node1.json").write_text("{}")
        return 7

    assert _private(command)(argparse.Namespace()) == 7
    assert runs.current_umask() == 0o022
    assert not_private(tmp_path / "made") == {}
    parser = build_parser()
    for argv in (["drain", "runs/x", "node1"], ["grow", "runs/x"]):
        assert parser.parse_args(argv).func.__qualname__ == "_private.<locals>.run", argv


def test_read_own_reads_only_a_regular_file_of_the_jobs_user(tmp_path):
    own = tmp_path / "own.json"
    own.write_text('{"nodes": 1}')
    assert runs.read_own(own) == '{"nodes": 1}'
    (tmp_path / "link.json").symlink_to(own)
    os.mkfifo(tmp_path / "fifo.json")  # (never opened for a blocking read)
    reasons = {}
    for name in ("link.json", "fifo.json"):
        with pytest.raises(runs.ForeignFile) as e:
            runs.read_own(tmp_path / name)
        reasons[name] = e.value.reason
    assert reasons == {"link.json": "is a symbolic link, not a file",
                       "fifo.json": "is not a regular file"}
    with pytest.raises(FileNotFoundError):
        runs.read_own(tmp_path / "missing.json")
    if os.geteuid() == 0:
        os.chown(own, NOBODY, NOBODY)
        with pytest.raises(runs.ForeignFile) as e:
            runs.read_own(own)
        assert e.value.reason == f"is owned by uid {NOBODY}, not by the job's user (uid 0)"
        assert isinstance(e.value, PermissionError)


def test_the_drain_watch_ignores_another_users_request_once_and_takes_the_users(tmp_path):
    needs_root()
    from oobleck_hpc.control.drain import DrainWatch, request_drain, request_path

    asked, ignored = [], []
    path = request_path(tmp_path, "node1")
    path.parent.mkdir()
    path.write_text(json.dumps({"node": "node1", "force": True, "by": "mallory"}))
    os.chown(path, NOBODY, NOBODY)
    watch = DrainWatch(tmp_path, "node1", lambda force, by: asked.append((force, by)),
                       file_poll_s=0.01, on_ignored=lambda p, why: ignored.append((p, why)))
    watch.start()
    try:
        wait_until(lambda: ignored, 10, "the foreign request reported")
        time.sleep(0.2)  # twenty more polls: reported once, never passed on
        assert ignored == [(path, f"is owned by uid {NOBODY}, not by the job's user (uid 0)")]
        request_drain(tmp_path, ["node1"], by="alice")  # the user's own: a new file
        wait_until(lambda: asked, 10, "the user's request passed on")
        assert asked == [(False, "alice")] and len(ignored) == 1
    finally:
        watch.stop()


def test_the_local_launcher_ignores_another_users_grow_request(tmp_path):
    """A grow request of another user is not answered: a `request_ignored` event (a console
    line) and the file removed; the user's own is answered as before."""
    needs_root()
    from types import SimpleNamespace

    from oobleck_hpc.config import JobConfig
    from oobleck_hpc.records.events import read_events
    from oobleck_hpc.launch.local import LocalRun, request_grow
    from oobleck_hpc.records.story import Story

    class Agents:
        def __init__(self):
            self.procs: dict = {}

        def add(self, count: int, on: list[str] | None = None) -> list[str]:
            self.procs["node5"] = SimpleNamespace(pid=1)
            return ["node5"]

    run = LocalRun(JobConfig(), tmp_path / "job.yaml", tmp_path, agents=Agents())
    foreign = request_grow(tmp_path, 4)
    os.chown(foreign, NOBODY, NOBODY)
    run._serve_grow()
    assert not foreign.exists() and not foreign.with_suffix(".done").exists()
    assert run.agents.procs == {}
    own = request_grow(tmp_path, 1)
    run._serve_grow()
    assert json.loads(own.with_suffix(".done").read_text()) == {"nodes": ["node5"]}
    events = [e for e in read_events(tmp_path / "events.jsonl")]
    assert [e["kind"] for e in events] == ["request_ignored", "nodes_added"]
    why = f"is owned by uid {NOBODY}, not by the job's user (uid 0)"
    assert (events[0]["request"], events[0]["path"], events[0]["reason"]) == \
        ("grow", str(foreign), why)
    assert Story().feed(events[0]) == [f"grow request ignored: {foreign} {why}"]
    # named nodes that are no names (a path) are refused before any agent starts
    bad = request_grow(tmp_path, 1, tag="bad", on=["../x"])
    run._serve_grow()
    assert "'on' must list node names" in json.loads(bad.with_suffix(".done").read_text())["error"]
    assert list(run.agents.procs) == ["node5"]


def test_a_linked_grow_request_is_ignored_once_and_removed(tmp_path):
    """A symbolic link in RUN_DIR/grow (to a file anywhere) is not followed (no root needed)."""
    from oobleck_hpc.config import JobConfig
    from oobleck_hpc.records.events import read_events
    from oobleck_hpc.launch.local import GROW_DIR, LocalRun

    target = tmp_path / "elsewhere.json"
    target.write_text('{"nodes": 3}')
    (tmp_path / GROW_DIR).mkdir()
    link = tmp_path / GROW_DIR / "1-1.request"
    link.symlink_to(target)
    run = LocalRun(JobConfig(), tmp_path / "job.yaml", tmp_path, agents=None)
    run._serve_grow()
    run._serve_grow()
    assert not os.path.lexists(link) and target.exists()
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["kind"], e["reason"]) for e in events] == \
        [("request_ignored", "is a symbolic link, not a file")]

