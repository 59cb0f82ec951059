"""One way to wait for something: `wait_until(predicate, timeout_s, what)` polls `predicate`
every `every_s` seconds and returns its first truthy value, or raises TimeoutError naming
`what` after `timeout_s`. Standard library only (the control plane uses it too)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str,
               every_s: float = 0.1) -> T:
    """`predicate()`'s first truthy value; it is asked at once and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := predicate():
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
