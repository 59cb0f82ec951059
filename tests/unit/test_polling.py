"""The package's polling helpers (oobleck_hpc/polling.py)."""

from __future__ import annotations

import time

import pytest

from oobleck_hpc import polling
from oobleck_hpc.polling import wait_until


def test_wait_until_returns_the_first_truthy_value_and_asks_no_more():
    asked = []

    def third_time() -> str:
        asked.append(1)
        return "ready" if len(asked) == 3 else ""

    assert wait_until(third_time, 5.0, "the third ask", every_s=0.001) == "ready"
    assert len(asked) == 3


def test_wait_until_raises_timeout_naming_what_it_waited_for_after_asking_at_the_deadline():
    asked = []
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for the moon"):
        wait_until(lambda: asked.append(time.monotonic()), 0.2, "the moon", every_s=0.05)
    assert asked[-1] - t0 >= 0.2 and len(asked) >= 3


def test_pause_polls_finely_while_the_wait_is_young_then_coarsely(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", slept.append)
    now = time.monotonic()
    polling.pause(now)
    polling.pause(now - polling.FINE_FOR_S - 0.01)
    assert slept == [polling.FINE_S, polling.COARSE_S]
