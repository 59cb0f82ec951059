"""Small helpers shared by the multi-process and cluster tests (imported as `helpers`: pytest
puts this directory on sys.path)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned) or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
