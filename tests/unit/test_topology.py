"""The control plane's monitoring topology and suspicion rule (oobleck_hpc/control/topology.py),
pure: K rings with constant degree at any size, and lease expiries that suspect a node only
when most of its observers report it."""

from __future__ import annotations

from collections import deque

import pytest

from oobleck_hpc.control.membership import MembershipCore
from oobleck_hpc.control.topology import MONITORS, Detector, Monitor, Rings


def names(n: int) -> tuple[str, ...]:
    return tuple(f"n{i}" for i in range(n))


def diameter_from(rings: Rings, start: str) -> int:
    """Hops from `start` to the farthest node over watch edges (either direction)."""
    dist = {start: 0}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for nxt in rings.subjects(node) + rings.observers(node):
            if nxt not in dist:
                dist[nxt] = dist[node] + 1
                todo.append(nxt)
    assert len(dist) == len(rings.view), "the watch graph is not connected"
    return max(dist.values())


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 64, 1024, 16384])
def test_rings_have_constant_degree_are_inverse_and_connected(n):
    view = names(n)
    rings = Rings(view)
    for node in view:
        subjects, observers = rings.subjects(node), rings.observers(node)
        assert len(subjects) <= MONITORS and len(observers) <= MONITORS
        assert node not in subjects and node not in observers
        assert len(set(subjects)) == len(subjects)
        assert all(node in rings.observers(s) for s in subjects)
        if n > 1:
            assert observers and subjects
    if n > 1:
        hops = diameter_from(rings, view[0])
        print(f"\n[figures] {n} nodes: {hops} hops from n0 to the farthest node")
        assert hops <= max(2, 2 * n.bit_length())  # an expander: logarithmic, not N / 2


def test_rings_are_the_same_on_every_agent_and_follow_the_view():
    view = names(40)
    assert Rings(view).subjects("n7") == Rings(tuple(view)).subjects("n7")
    smaller = Rings(tuple(n for n in view if n != "n7"))
    assert all("n7" not in smaller.subjects(n) for n in smaller.view)
    assert all(smaller.observers(n) for n in smaller.view)


def hung(n: int = 20) -> tuple[Rings, str, tuple[str, ...]]:
    rings = Rings(names(n))
    subject = "n5"
    return rings, subject, rings.observers(subject)


def test_a_hung_node_is_suspected_once_most_of_its_observers_report_it():
    rings, subject, observers = hung()
    assert len(observers) == MONITORS
    me = observers[0]
    d = Detector(me, lease_s=1.0)
    d.watch(1, rings.view, now=0.0)
    assert subject in d.subjects
    for node in d.subjects:
        d.heard(node, 0.5)
    assert d.expired(1.4, skip=set()) == []
    d.heard(d.subjects[-1] if d.subjects[-1] != subject else d.subjects[0], 1.0)
    (got,) = [x for x in d.expired(1.6, skip=set()) if x[0] == subject]
    assert got[1].startswith("lease_expired")
    need = MONITORS // 2 + 1
    results = [d.report(subject, o, gone={me}) for o in observers[:need]]
    assert results == [False] * (need - 1) + [True]


def test_one_slow_observer_cannot_evict_and_reports_of_non_observers_do_not_count():
    rings, subject, observers = hung()
    d = Detector(observers[0], lease_s=1.0)
    d.watch(1, rings.view, now=0.0)
    assert not d.report(subject, observers[1], gone=set())
    outsider = next(n for n in rings.view if n not in observers and n != subject)
    assert not d.report(subject, outsider, gone=set())
    assert d.reporters(subject) == {observers[1]}


def test_an_observer_counts_itself_so_the_other_of_two_observers_cannot_evict_alone():
    """A subject with two observers (node3 of 5 nodes): one observer's report does not make the
    other suspect it while the other's own lease holds -- both must report. (Seen before the
    fix in tests/test_recovery.py::test_kill_during_reconfiguration: the monitor passed itself
    as gone, so node2 evicted a healthy node3 on node1's report alone.) With three, two
    reports suffice whoever makes them."""
    rings = Rings(tuple(f"node{i}" for i in range(5)))
    assert set(rings.observers("node3")) == {"node1", "node2"}
    d = Detector("node2", lease_s=1.0)
    d.watch(1, rings.view, now=0.0)
    assert not d.report("node3", "node1", gone={"node2"})
    assert d.report("node3", "node2", gone={"node2"})  # its own lease expired too
    three = Detector("node0", lease_s=1.0)
    three.watch(1, rings.view, now=0.0)
    assert set(rings.observers("node4")) == {"node0", "node1", "node2"}
    assert not three.report("node4", "node1", gone={"node0"})
    assert three.report("node4", "node2", gone={"node0"})


def test_observers_that_fail_lower_the_bar_and_a_new_generation_forgets_reports():
    rings, subject, observers = hung()
    d = Detector(observers[0], lease_s=1.0)
    d.watch(1, rings.view, now=0.0)
    assert not d.report(subject, observers[0], gone=set())
    assert d.recount(gone=set()) == []
    # three of its four observers died with it (one switch): the one left decides
    assert d.recount(gone=set(observers[1:])) == [subject]
    d.watch(2, rings.view, now=5.0)
    assert d.reporters(subject) == set()


def test_a_new_edge_gets_a_fresh_lease_and_a_silent_subject_is_reported_again():
    rings = Rings(names(10))
    me = "n0"
    d = Detector(me, lease_s=1.0)
    d.watch(0, rings.view, now=0.0, grace_s=4.0)  # generation 0: startup grace
    (s, *_) = d.subjects
    assert d.expired(4.9, skip=set()) == []
    assert (s, False) in [(x[0], x[2]) for x in d.expired(5.1, skip=set())]
    assert s not in [x[0] for x in d.expired(5.5, skip=set())]  # reported less than lease_s ago
    # silent still: reported again, and after two leases suspected by this observer alone
    assert (s, True) in [(x[0], x[2]) for x in d.expired(6.2, skip=set())]
    assert s not in [x[0] for x in d.expired(9.0, skip={s})]
    # a subject that only appears in a later generation is given its own lease from then on
    smaller = tuple(n for n in rings.view if n != s)
    d.watch(1, smaller, now=20.0)
    fresh = [n for n in d.subjects if n not in rings.subjects(me)]
    assert all(n not in [x[0] for x in d.expired(20.9, skip=set())] for n in fresh)
    # a subject never heard from during the start's grace is due at once in a new generation
    # (seen: a node hung 0.6 s after the start was found only after two leases)
    d2 = Detector(me, lease_s=1.0)
    d2.watch(0, rings.view, now=0.0, grace_s=50.0)
    d2.watch(1, rings.view, now=2.0)
    assert [x[0] for x in d2.expired(3.1, skip=set())] == list(d2.subjects)
    joiner = "n99"
    d.watch(1, smaller, now=21.0, extra=(joiner,))
    assert joiner in d.subjects
    (got,) = [x for x in d.expired(22.1, skip=set()) if x[0] == joiner]
    assert got[1:] == ("never_connected", False)
    assert d.report(joiner, me, gone={me})  # outside the rings: this member's report suffices


def test_lateness_is_the_largest_of_the_window_and_forgets_what_is_older():
    """A sliding maximum (topology.py, `Lateness`), against the maximum over the window by hand."""
    import random

    from oobleck_hpc.control.topology import Lateness

    rng = random.Random(7)
    gauge, seen = Lateness(window_s=5.0), []
    for i in range(2000):
        now, late = i * 0.05, rng.choice([0.0, -0.1, rng.random()])
        gauge.note(now, late)
        seen.append((now, late))
        expect = max([x for t, x in seen if t >= now - 5.0 and x > 0], default=0.0)
        assert gauge.recent(now) == expect
    assert len(gauge._seen) < 100  # decreasing from the front: bounded by the window


def test_the_monitor_measures_late_heartbeats_of_its_subjects_and_its_own_late_ticks():
    """A subject's gap beyond 1.5 heartbeats and a tick late beyond half a heartbeat are
    lateness; a message from a node that does not heartbeat this agent says nothing."""
    from oobleck_hpc.control.membership import MembershipCore
    from oobleck_hpc.control.topology import Monitor

    view = names(8)
    core = MembershipCore("n0", view, 1234, lambda: 1235)
    mon = Monitor(core, heartbeat_s=0.5, lease_s=3.0, startup_s=10.0)
    mon.start(0.0)
    mon.tick(0.25)
    subject = mon.detector.subjects[0]
    stranger = next(n for n in view[1:] if n not in mon.detector.subjects)
    for t in (0.5, 1.0, 1.5):
        mon.message(subject, {"type": "heartbeat", "gen": 0}, t)
        mon.message(stranger, {"type": "heartbeat", "gen": 0}, t)
    mon.tick(0.5)
    assert mon.lateness.recent(1.5) == 0.0
    mon.tick(1.35)  # the ticker ran 0.6 s late
    assert mon.lateness.recent(1.35) == pytest.approx(0.6)
    mon.lateness = type(mon.lateness)()
    mon.message(stranger, {"type": "heartbeat", "gen": 0}, 2.5)  # silent 1 s: not its duty
    assert mon.lateness.recent(2.5) == 0.0
    mon.message(subject, {"type": "heartbeat", "gen": 0}, 2.6)  # 1.1 s apart: 0.35 s late
    assert mon.lateness.recent(2.6) == pytest.approx(0.35)


def heard_monitor(start_lease_s: float = 0.0) -> tuple[Monitor, list[str]]:
    """n0's Monitor of 5 nodes (heartbeat 0.5 s, lease 3 s), its subjects heard at 0.5 s; the
    list of the subjects it reports from then on."""
    mon = Monitor(MembershipCore("n0", names(5), 1234, lambda: 1235), heartbeat_s=0.5,
                  lease_s=3.0, startup_s=0.0, start_lease_s=start_lease_s)
    reported: list[str] = []
    mon.report = lambda subject, observer, how: reported.append(subject)  # type: ignore
    mon.start(0.0)
    mon.tick(0.25)
    for s in mon.detector.subjects:
        mon.message(s, {"type": "heartbeat", "gen": 0}, 0.5)
    return mon, reported


def test_an_observers_own_pause_extends_its_leases_and_the_stall_probe_keeps_true_times():
    """A tick over two heartbeats late (this agent was not scheduled) moves every lease's start
    on by the pause: at the first tick after a 2.5 s pause, a subject heard 3.05 s ago is not
    reported (two observers did so together in a test, evicting a healthy node); one silent
    for a lease past the pause still is. A late tick within jitter moves nothing, and
    `last_heard` keeps the true time."""
    def monitor(ticks) -> tuple[Monitor, list[str]]:
        """Subjects heard at 0.5 s, then the ticks at `ticks`; what the monitor reported."""
        mon, reported = heard_monitor()
        for t in ticks:
            mon.tick(t)
        return mon, reported

    steady = [0.5 + 0.25 * i for i in range(12)]  # 0.5 ... 3.25
    mon, reported = monitor(steady + [3.55])  # 0.3 s apart: jitter; the leases end at 3.5
    assert sorted(reported) == sorted(mon.detector.subjects)
    mon, reported = monitor([0.75, 1.0, 3.55])  # paused 2.55 s: heard 3.05 s ago, 0.75 s awake
    assert reported == []
    assert all(mon.detector.last_heard[s] == 0.5 for s in mon.detector.subjects)
    mon, reported = monitor([0.75, 1.0, 3.55] + [3.55 + 0.25 * i for i in range(1, 10)])
    assert reported == []  # 0.5 + 2.3 s excused + 3.0 s lease = 5.8 s
    mon.tick(5.85)
    assert sorted(reported) == sorted(mon.detector.subjects)


def test_the_start_has_a_longer_lease_for_the_subjects_and_no_pause_fences_the_agent():
    """Until `started()` (every rank of the start built its engine), a subject's lease is the
    start's (3 x lease_s for the agents): healthy agents unscheduled for 3.0 s and 4.5 s while
    ten workers imported torch were excluded before step 1 in CI. From `started()` on, lease_s
    again. This agent's own pause, however long, fences nothing (its peers may have paused with
    it: module docstring, `Own pause`); the leases it holds are moved on by it."""
    from oobleck_hpc.control.topology import START_LEASE_FACTOR

    mon, reported = heard_monitor(START_LEASE_FACTOR * 3.0)
    for t in [0.5 + 0.25 * i for i in range(1, 35)]:  # silent subjects, until 9.0 s
        mon.tick(t)
    assert reported == [] and not mon.core.fenced
    mon.tick(9.6)  # silent 9.1 s: over the start's lease
    assert sorted(reported) == sorted(mon.detector.subjects)

    mon, reported = heard_monitor(START_LEASE_FACTOR * 3.0)
    mon.tick(5.0)  # this agent unscheduled for 4.5 s during the start: no fence
    assert not mon.core.fenced
    mon.started()
    for t in [5.0 + 0.25 * i for i in range(1, 13)]:  # the pause excused: due at 8.0 s
        mon.tick(t)
    assert reported == []
    mon.tick(8.1)  # lease_s past the excused pause
    assert sorted(reported) == sorted(mon.detector.subjects)
    mon.tick(11.5)  # unscheduled 3.4 s, over lease_s, once started: not fenced
    assert not mon.core.fenced


def test_a_round_without_agreement_fences_for_a_requeue_and_an_own_pause_is_excused():
    """A round that keeps one proposal for agreement_timeout_s (2 x lease_s: 6 s) without a
    decision fences this node with exit 75 (it cannot prove it is in the majority). This
    agent's own pause does not count against that wait, as it does not against its leases."""
    def run(ticks: list[float]) -> Monitor:
        mon, _ = heard_monitor()
        mon.core.suspect("n3", "test")  # a round opens; nobody answers it
        assert mon.core.proposal is not None
        for t in ticks:
            for s in mon.detector.subjects:  # (the subjects heartbeat on)
                mon.message(s, {"type": "heartbeat", "gen": 0}, t)
            mon.tick(t)
        return mon

    steady = [0.75 + 0.25 * i for i in range(24)]  # to 6.5 s: the round's wait began at 0.75
    mon = run(steady)
    assert not mon.core.fenced
    mon = run(steady + [6.8])
    assert mon.core.fenced and "agreement" in mon.core.fenced and mon.core.fence_code == 75
    paused = [0.75, 1.0, 5.5]  # unscheduled 4.5 s: 4.25 s excused, the wait ends at 11.0 s
    mon = run(paused + [5.5 + 0.25 * i for i in range(1, 22)])  # to 10.75 s
    assert not mon.core.fenced, mon.core.fenced
    mon.tick(11.1)
    assert mon.core.fenced and mon.core.fence_code == 75
