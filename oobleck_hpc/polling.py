"""One way to wait for something: `wait_until(predicate, timeout_s, what)` polls `predicate`
every `every_s` seconds and returns its first truthy value, or raises TimeoutError naming
`what` after `timeout_s`; `pause(since)` paces a loop that polls something which is usually
there within milliseconds. Standard library only (the control plane uses it too)."""

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


FINE_S, COARSE_S, FINE_FOR_S = 0.002, 0.02, 0.25


def pause(since: float) -> None:
    """Sleep before polling again, in a wait that began at `since` (time.monotonic()):
    FINE_S for its first FINE_FOR_S, COARSE_S after. A recovery's rendezvous polls like this:
    its ranks arrive within milliseconds of each other, and a coarse sleep alone put a whole
    COARSE_S into every recovery (bench/recovery.py, kill: most ranks waited 21 ms there, of a
    regroup of 58-79 ms)."""
    time.sleep(FINE_S if time.monotonic() - since < FINE_FOR_S else COARSE_S)
