"""Small helpers shared by the multi-process and cluster tests (imported as `helpers`: pytest
puts this directory on sys.path)."""

from __future__ import annotations

from oobleck_hpc.polling import wait_until  # noqa: F401 (re-exported for the tests)


def not_private(root, group_access: bool = False) -> dict[str, str]:
    """Every path under `root` (itself included) whose mode is not a run's (oobleck_hpc/records/runs.py,
    "Private"): 0700 folders and 0600 files, or 0750 and 0640 with `group_access`; the secret
    0600 always (a symbolic link has no mode of its own: its target is checked where it lies).
    Returns path -> its mode."""
    import stat
    from pathlib import Path

    root = Path(root)
    bad = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if path.is_dir():
            want = 0o750 if group_access else 0o700
        else:
            want = 0o640 if group_access and path.name != "secret" else 0o600
        if st.st_mode & 0o777 != want:
            bad[str(path.relative_to(root))] = oct(st.st_mode & 0o777)
    return bad


def as_nobody(cwd, *commands: list[str]) -> list:
    """Run each command as the user `nobody` (group nogroup, no others) in `cwd`: another user
    of the machine. Needs root (the tests' CI runs as root); skips the test otherwise. Give a
    `cwd` whose own mode lets others in (pytest's tmp_path is 0700): the commands' relative
    paths are resolved from it, so what they are refused is refused below it."""
    import os
    import pwd
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root, to run commands as another user (nobody)")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    return [subprocess.run(argv, cwd=cwd, user=nobody.pw_uid, group=nobody.pw_gid,
                           extra_groups=[], capture_output=True, text=True, timeout=30)
            for argv in commands]


def start_retries(events: list[dict]) -> list[dict]:
    """The events of retry rounds at a run's start, which tests of other features allow: step 1
    failed on a collective timeout while every node lived, and the round that followed kept
    the same nodes (its `recovered` event at step 1 lost, added and drained nobody). On the
    loaded 2-core CI machine the ranks of a fresh start reach their first collective seconds
    apart, past the collective timeout (seen in CI: a drain test's step 1 timed out in
    gradient_sync). Returns those `recovered` events and the `step_failed` events of step 1
    in the generations they replaced."""
    retried = [e for e in events if e["kind"] == "recovered" and e["step"] == 1
               and not e["lost"] and not e["joined"] and not e.get("drained")]
    if not retried:
        return []
    last = max(e["generation"] for e in retried)
    return retried + [e for e in events if e["kind"] == "step_failed" and e["step"] == 1
                      and e["generation"] < last]


def past_start_retries(events: list[dict]) -> list[dict]:
    """`events` without those of a start's retry rounds (`start_retries`)."""
    retries = start_retries(events)
    return [e for e in events if e not in retries]


def run_digest(run_dir, last: int = 20) -> str:
    """What a local run's files say, for a test whose run did not end (pytest-timeout shows only
    where the test waited, and the CI keeps no run directory): the last step in its metrics,
    the last `last` lines of its story and its last `last` events, one short line each."""
    import json
    from pathlib import Path

    from oobleck_hpc.records.runs import read_jsonl
    from oobleck_hpc.records.story import tell

    run_dir = Path(run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    if not events:
        return f"{run_dir}: no events"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    t0 = events[0]["t"]
    lines = [f"{run_dir}: {len(events)} events over {events[-1]['t'] - t0:.1f} s; last step in "
             f"the metrics: {rows[-1].get('step') if rows else None}", "story (end):"]
    lines += ["  " + s for s in tell(events)[-last:]]
    lines.append("events (end):")
    skip = {"t", "kind", "source", "run", "host", "pid"}
    for e in events[-last:]:
        rest = json.dumps({k: v for k, v in e.items() if k not in skip}, default=str)
        lines.append(f"  +{e['t'] - t0:7.2f} {e.get('source', '?')} {e['kind']} {rest[:160]}")
    return "\n".join(lines)
