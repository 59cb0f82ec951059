"""Straggler detection and the re-split (pure: recovery/straggler.py, planning/instantiate.py), and
the slow fault that makes a straggler (control/faults.py: two busy-loop processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from oobleck_hpc.recovery.straggler import RECOVERED, Tracker, choose
from oobleck_hpc.planning.cost import predicted_step_ms
from oobleck_hpc.planning.instantiate import resplit
from test_chaos import _plan

NODES = ("a", "b", "c", "d")


def feed(t: Tracker, steps: int, slow: dict[str, float] | None = None, seconds: float = 0.1,
         base: dict[str, float] | None = None):
    """`steps` steps of ratios (each node's `base`, times its `slow` factor); what was found."""
    found, recovered = {}, []
    for _ in range(steps):
        f, r = t.observe({n: (base or {}).get(n, 1.0) * (slow or {}).get(n, 1.0)
                          for n in NODES}, seconds)
        found.update(f)
        recovered += r
    return found, recovered


def test_a_node_is_slow_once_its_window_median_is_over_the_ratio_against_its_own_baseline():
    t = Tracker(ratio=1.5, steps=5)
    base = {"a": 1.0, "b": 1.7, "c": 0.6, "d": 1.0}  # profiles err per stage: baselines differ
    assert feed(t, 5, base=base) == ({}, [])  # the baselines
    assert feed(t, 20, base=base) == ({}, [])  # b is 1.7x its prediction, but always was
    assert feed(t, 1, {"b": 3.0}, base=base) == ({}, [])  # one noisy step decides nothing
    assert feed(t, 1, {"b": 3.0}, base=base) == ({}, [])
    found, _ = feed(t, 1, {"b": 2.0}, base=base)  # 3 of the last 5 slowed: the median is
    assert list(found) == ["b"] and 1.9 < found["b"] < 2.1  # (b's slowdown, not its ratio)
    assert t.slow == found
    # recovered once its window's median is back under RECOVERED
    found, recovered = feed(t, 5, base=base)
    assert found == {} and recovered == ["b"] and t.slow == {}


def test_a_machine_slower_everywhere_has_no_straggler():
    t = Tracker(ratio=1.5, steps=5)
    feed(t, 5)
    assert feed(t, 20, {n: 2.5 for n in NODES}) == ({}, [])


def test_the_window_spans_window_s_seconds_of_steps_as_well():
    t = Tracker(ratio=1.5, steps=5, window_s=2.0)
    assert feed(t, 40, seconds=0.1) == ({}, [])  # baselines (2 s: 20 steps), then a window
    found, _ = feed(t, 9, {"c": 2.0}, seconds=0.1)
    assert found == {}  # 9 slowed steps of 20 (5 would do without window_s)
    found, _ = feed(t, 2, {"c": 2.0}, seconds=0.1)
    assert list(found) == ["c"]  # 11 of 20


def test_after_a_plan_made_for_it_recovery_is_relative_to_its_slowdown():
    t = Tracker(ratio=1.5, steps=5)
    feed(t, 10)
    found, _ = feed(t, 3, {"d": 3.0})
    assert list(found) == ["d"]
    t.restart()  # a new plan: its baselines are taken while d is still slow
    feed(t, 5, {"d": 3.0})
    assert feed(t, 10, {"d": 3.0}) == ({}, [])  # still slow: nothing changes
    _, recovered = feed(t, 5)  # fast again: 1/3 of its new baseline, under RECOVERED / 3
    assert recovered == ["d"] and 1 / 3 < RECOVERED / 3


def test_rebalance_gives_the_slow_pipeline_fewer_microbatches_and_choose_takes_the_fastest():
    profile, templates, plan = _plan(0, 10**9, 1, 3)  # pipelines of [2, 2, 2] nodes
    p0 = plan.pipelines[0]
    node = p0.nodes[0]
    assert resplit(plan, profile, {}).digest() == plan.digest() or \
        [p.microbatches for p in resplit(plan, profile, {}).pipelines] == \
        [p.microbatches for p in plan.pipelines]
    slow = resplit(plan, profile, {node: 3.0})
    assert slow.pipelines[0].microbatches < p0.microbatches
    assert sum(p.microbatches for p in slow.pipelines) == plan.global_microbatches
    assert (predicted_step_ms(slow, profile, {node: 3.0})
            < predicted_step_ms(plan, profile, {node: 3.0}))
    c = choose(plan, profile, templates, 1, node, 3.0, plan.nodes)
    assert c.action in ("rebalance", "exclude")
    assert c.predicted_ms[c.action] == min(c.predicted_ms.values())
    # forced, or nothing worth doing
    assert choose(plan, profile, templates, 1, node, 3.0, plan.nodes, "rebalance").action == \
        "rebalance"
    assert choose(plan, profile, templates, 1, node, 1.01, plan.nodes).action == "keep"


def test_the_slow_fault_stretches_a_process_s_computation_by_its_factor():
    """DutyCycle (control/faults.py): a busy loop slowed 3x gets a third of the CPU time that
    the same loop beside it gets unslowed (measured side by side: the machine may be shared)."""

    from oobleck_hpc.control.faults import DutyCycle

    def cpu_s(pid: int) -> float:  # (not the fault's own clock: that is what is checked)
        with open(f"/proc/{pid}/stat") as f:
            utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        slowed = loops[0]
        duty = DutyCycle(lambda: [slowed.pid], 3.0).start()
        cpu0 = [cpu_s(p.pid) for p in loops]
        time.sleep(2.0)
        cpu = [cpu_s(p.pid) - c for p, c in zip(loops, cpu0)]
        duty.stop()
        assert 0.2 < cpu[0] / cpu[1] < 0.45, cpu
    finally:
        for p in loops:
            p.kill()
            p.wait()
