"""Shared fixtures. The local Slurm cluster (slurm/dev-cluster.sh) is brought up by
scripts/test.sh before pytest and torn down after; tests that need it take `slurm_cluster`."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV_CLUSTER = ROOT / "slurm" / "dev-cluster.sh"


@pytest.fixture
def float64() -> Iterator[None]:
    """torch's default dtype float64 for the test (exact comparisons), restored after it."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def slurm_cluster() -> Iterator[Path]:
    """The local Slurm cluster with its 4 nodes idle (revives a node an earlier test killed).

    Skips when the cluster is not up, unless OOBLECK_REQUIRE_SLURM=1 (set by scripts/test.sh,
    so CI fails instead of skipping). Yields the dev-cluster script; SLURM_CONF is exported.
    Holds an exclusive lock on the cluster for the test: two pytest runs on one machine would
    otherwise kill and freeze nodes under each other's jobs."""
    conf = subprocess.run([str(DEV_CLUSTER), "env"], capture_output=True, text=True,
                          check=True).stdout.strip().removeprefix("export SLURM_CONF=")
    os.environ["SLURM_CONF"] = conf
    up = Path(conf).exists() and subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True).stdout.count("UP") > 0
    if not up:
        if os.environ.get("OOBLECK_REQUIRE_SLURM") == "1":
            pytest.fail("the local Slurm cluster is not up (slurm/dev-cluster.sh up)")
        pytest.skip("local Slurm cluster not up: run slurm/dev-cluster.sh up")
    lock_path = Path(conf).parent.parent / "tests.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Idempotent: restarts a slurmd that a test killed and waits for all nodes to be usable.
        subprocess.run([str(DEV_CLUSTER), "up"], check=True, timeout=120, capture_output=True)
        _quiet_cluster()
        yield DEV_CLUSTER


def _quiet_cluster(timeout_s: float = 60.0) -> None:
    """No job of an earlier test left (e.g. the one-node run that publishes a lost batch
    node's outcome) and every node idle, so that the next test's job starts at once on all of
    them. The cluster belongs to the tests (under the lock above): what an earlier test left
    behind is cancelled by job id."""
    import time

    def queue() -> list[str]:
        return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                              timeout=30).stdout.split()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = queue()
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True,
                                text=True, timeout=30).stdout.split()
        if not jobs and states and all(s == "idle" for s in states):
            return
        if jobs and time.monotonic() > deadline - timeout_s / 2:
            subprocess.run(["scancel", *jobs], timeout=30)
        time.sleep(0.5)
    pytest.fail(f"the local Slurm cluster did not become idle within {timeout_s:.0f} s "
                f"(jobs {queue()})")
