"""A run's files are its user's alone (issue 28; oobleck_hpc/runs.py, "Private").

- `runs.begin` makes RUN_DIR 0700 (0750 with the job's `group_access`) even when it was made
  0755 before, and what it writes is 0600 (0640); the secret is 0600 either way; the caller's
  umask is left as it was.
- `runs.private_files` is umask 077 (027 with group_access), restored after; `drain` and `grow`
  run under it; `bootstrap umask JOB` tells slurm/train.sbatch which one a job wants.

A real run's files (modes, and reads as the user `nobody`) are checked where a run already
happens: tests/test_resume.py (the fallback run: checkpoints, final state, logs, roster, events,
secret).
"""

from __future__ import annotations

import os
import stat

import pytest
from helpers import not_private

from oobleck_hpc import runs

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
    from oobleck_hpc.launch.cli import _private

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
