"""The stall watch (recovery/stall.py): when a wait inside a step is a stall, on a fake clock;
the report of a recovery's late rendezvous (`watched`, `missing_nodes`)."""

from __future__ import annotations

from types import SimpleNamespace

from oobleck_hpc.config import STALL_FLOOR_S, STALL_MULTIPLE
from oobleck_hpc.engine.state import Waiting
from oobleck_hpc.recovery.stall import StallWatch, Wait, current_wait


def wait(since: float = 100.0, gen: int = 0, step: int = 5) -> Wait:
    return Wait(since, "gradient_sync", ("node2",), gen, step)


def test_no_stall_before_a_step_committed():
    """The first step allocates and may take long: nothing is a stall before a usual time."""
    w = StallWatch()
    assert w.threshold is None
    assert w.due(wait(), 1e6) is None


def test_threshold_is_a_multiple_of_the_usual_step_bounded_below():
    w = StallWatch(floor_s=0.4, multiple=3.0, steps=3)
    w.observe(0.05)
    assert w.threshold == 0.4  # short steps: the floor
    for s in (1.0, 1.0, 1.0):
        w.observe(s)
    assert w.threshold == 3.0  # the window forgot the first step
    w.observe(0.01)
    assert w.threshold == 3.0  # the median: one fast step changes nothing
    first = StallWatch(floor_s=0.4, multiple=3.0)
    first.observe(1.2)  # the first step allocates
    first.observe(0.08)
    assert first.threshold == 0.4  # the low median: the second step's, not their mean
    assert StallWatch().threshold is None and (STALL_FLOOR_S, STALL_MULTIPLE) == (
        StallWatch().floor_s, StallWatch().multiple)


def test_a_stall_is_reported_once_per_generation_and_step():
    w = StallWatch(floor_s=0.4, multiple=3.0)
    w.observe(0.1)  # threshold 0.4 s
    assert w.due(None, 200.0) is None
    assert w.due(wait(since=100.0), 100.39) is None
    stall = w.due(wait(since=100.0), 100.41)
    assert stall is not None and abs(stall.waited_s - 0.41) < 1e-9 and stall.threshold_s == 0.4
    assert "node2" in stall.detail and "step 6" in stall.detail  # steps shown from 1
    # the same step, a later wait: already reported (the probe answers for it)
    assert w.due(wait(since=101.0), 105.0) is None
    # the step replayed in the next generation, and the next step, may stall again
    assert w.due(wait(since=110.0, gen=1), 111.0) is not None
    assert w.due(wait(since=120.0, gen=1, step=6), 121.0) is not None


def test_a_straggler_slows_the_usual_step_too():
    """A node slowed 2x makes every step 2x: once its steps are the usual ones, a wait as long
    as such a step is no stall."""
    w = StallWatch(floor_s=0.4, multiple=3.0, steps=4)
    for _ in range(4):
        w.observe(0.5)
    assert w.due(wait(since=0.0), 1.0) is None
    assert w.due(wait(since=0.0), 1.6) is not None


def test_current_wait_names_the_nodes_waited_on():
    plan = SimpleNamespace(ranks=[SimpleNamespace(node=n) for n in
                                  ("node0", "node0", "node1", "node1", "node2", "node2")])
    engine = SimpleNamespace(plan=plan, state=SimpleNamespace(step=7),
                             waiting=Waiting(3.0, "reduce", (0, 2, 3, 5)))
    s = SimpleNamespace(gen=2, voting=None, engine=engine)
    assert current_wait(s) == Wait(3.0, "reduce", ("node0", "node1", "node2"), 2, 7)
    engine.waiting = None
    assert current_wait(s) is None
    s.voting = (4.0, 7)  # the commit vote: who has not voted only the agents know
    assert current_wait(s) == Wait(4.0, "vote", (), 2, 7)
    s.voting, s.engine = None, None
    assert current_wait(s) is None


def test_a_reported_threshold_is_a_finite_positive_number_or_nothing():
    """The agent reads a stall's threshold from its worker's message (control/stall_probe.py):
    anything but a finite positive number counts as none."""
    from oobleck_hpc.control.stall_probe import reported_threshold

    assert reported_threshold(0.9) == 0.9 and reported_threshold(2) == 2.0
    for bad in (None, "0.9", -1.0, 0.0, float("nan"), float("inf"), True, [1.0]):
        assert reported_threshold(bad) == 0.0, bad


class CountingStore:
    """The store calls of `wait_arrivals` and `missing_nodes` (add), in memory."""

    def __init__(self, counts: dict[str, int]):
        self.counts = dict(counts)

    def add(self, key: str, n: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def test_the_rendezvous_knows_which_nodes_ranks_have_not_arrived():
    from oobleck_hpc.recovery.rendezvous import missing_nodes, wait_arrivals

    # nodes a, b, c with 2 ranks each: one of b's and a's other rank have arrived before
    store = CountingStore({"arrived": 2, "arrived/a": 1, "arrived/b": 1})
    assert missing_nodes(store, "arrived", ["a", "b", "c"], 2) == ["a", "b", "c"]
    store.counts["arrived"] = 5  # (all but this one: it arrives and finds everyone there)
    wait_arrivals(store, "arrived", "a", 6, 30.0)
    assert missing_nodes(store, "arrived", ["a", "b", "c"], 2) == ["b", "c"]


def test_a_wait_outside_a_step_reports_the_late_nodes_once_and_goes_on():
    """A recovery's rendezvous (recovery/stall.py's docstring): once it has waited the stall's
    threshold, the nodes still late are reported, once -- none, nothing: an empty list of
    suspects would have every member probed; the wait's own abort decides as before."""
    import time

    from oobleck_hpc.recovery.stall import watched

    reports = []
    client = SimpleNamespace(report_failure=lambda *a, **kw: reports.append((a, kw)))
    stalls = StallWatch(floor_s=0.05, multiple=1.0)
    stalls.observe(0.01)  # threshold 0.05 s
    s = SimpleNamespace(stalls=stalls, client=client)
    late = [["a", "b"]]
    check = watched(s, 3, "the rendezvous", lambda: late[0], lambda: False)
    assert check() is False and not reports  # (the first call starts the clock)
    time.sleep(0.06)
    assert check() is False
    (args, kw), = reports
    assert args[0] == "stall" and args[2] == ["a", "b"] and kw == {"gen": 3, "threshold_s": 0.05}
    time.sleep(0.06)
    check()
    assert len(reports) == 1
    late[0] = []
    check = watched(s, 3, "the rendezvous", lambda: late[0], lambda: True)
    check()
    time.sleep(0.06)
    assert check() is True and len(reports) == 1


def test_a_transfer_waits_on_the_ranks_it_sends_to_or_receives_from():
    """What a recovery's watched transfer names (recovery/transfer.py, `peers`): the other ends
    of this rank's moves."""
    from oobleck_hpc.planning.reconfigure import Transfer
    from oobleck_hpc.recovery.transfer import peers

    moves = [Transfer(0, 1, 4, 8), Transfer(1, 4, 2, 8), Transfer(2, 3, 5, 8), Transfer(4, 6, 4, 8)]
    assert peers(moves, 4) == [1, 2, 6]
    assert peers(moves, 3) == [5]
    assert peers(moves, 0) == []
