"""The fleet manager's logic (fleet/manager.py) on made-up job events, and `fleet status` on the
events it writes: no processes (tests/test_fleet_run.py runs the real thing)."""

from __future__ import annotations

import json

import numpy as np

from oobleck_hpc.fleet.manager import Drain, Grow, JobState, Manager, Start, Stop
from oobleck_hpc.fleet.status import format_status, read_status
from oobleck_hpc.records.events import EventLog

# a planner-like curve: no plan below 2 nodes, more nodes pay less and less
SPS = np.array([0.0, 0.0, 10.0, 12.0, 13.0, 13.5, 13.8, 14.0, 14.1])


def fleet(emit, pool: int = 8, wait_light: bool = False) -> Manager:
    jobs = [JobState("heavy", 4 * SPS, max_nodes=3, transition_s=60),
            JobState("middle", 2 * SPS, max_nodes=2, transition_s=60),
            JobState("light", SPS, min_nodes=4 if wait_light else 1, transition_s=60)]
    return Manager(jobs, pool, 3 * 3600.0, emit)


def plan(nodes: int) -> dict:
    return {"kind": "plan_chosen", "nodes": nodes}


def recovered(lost: list[str], drained: list[str] = (), seconds: float = 0.3) -> dict:
    return {"kind": "recovered", "lost": lost, "drained": list(drained), "step": 3,
            "seconds": seconds}


def test_a_loss_in_the_heaviest_job_moves_a_node_from_the_lightest():
    out: list[tuple[str, dict]] = []
    m = fleet(lambda kind, **f: out.append((kind, f)))
    assert m.start() == [Start("heavy", 3), Start("middle", 2), Start("light", 3)]
    assert m.on_event("heavy", plan(2)) == []
    assert m.on_event("heavy", recovered(["node2"])) == [Drain("light", "node2", "heavy")]
    decision = [f for k, f in out if k == "fleet_decision"][1]  # [0]: the first allocation
    assert decision["nodes_after"] == {"heavy": 3, "middle": 2, "light": 2}
    assert decision["waf_after"] > decision["waf_before"] and decision["enacted"]
    assert not m.settled()
    # meanwhile middle ends: its nodes are free, re-solved once the move is over
    assert m.on_exit("middle", 0, True) == []
    assert m.on_event("light", {"kind": "drain_agreed", "nodes": ["node2"]}) == [
        Grow("heavy", 1, "light")]
    assert m.on_event("light", recovered(["node2"], ["node2"])) == []  # a drain: no trigger
    assert m.on_event("light", plan(2)) == []
    # settled: middle's end is re-solved; light, below the 3 nodes it started with, gets one
    assert m.on_event("heavy", plan(3)) == [Grow("light", 1, "")]
    last = [f for k, f in out if k == "fleet_decision"][-1]
    assert last["trigger"] == "middle" and last["moves"] == [["light", 2, 3]], last
    assert m.on_event("light", plan(3)) == [] and m.settled()
    # no job gets more than it started with: a local grown node would wait as a spare
    assert m.counts() == {"heavy": 3, "middle": 0, "light": 3} and m.free == 1


def test_moves_are_charged_the_jobs_measured_pauses():
    """A pause of a day (the fleet file's guess) makes no move pay over the 3-h MTBF; once
    each job measured its own (its `recovered` events' seconds, their median), the same loss
    moves a node."""
    for measured, moves in ((False, []), (True, [Drain("light", "node2", "heavy")])):
        out: list[tuple[str, dict]] = []
        m = fleet(lambda kind, **f: out.append((kind, f)))
        for j in m.jobs.values():
            j.transition_s = 86400.0
        m.start()
        if measured:  # (e.g. the joins of an earlier move, and a loss)
            m.on_event("light", recovered([], seconds=0.5))
            m.on_event("heavy", recovered([], seconds=0.1))
            m.on_event("heavy", recovered([], seconds=0.9))
        m.on_event("heavy", plan(2))
        assert m.on_event("heavy", recovered(["node2"], seconds=0.2)) == moves
        decision = [f for k, f in out if k == "fleet_decision"][-1]
        pauses = {"heavy": 0.2, "middle": 86400.0, "light": 0.5} if measured else {
            "heavy": 0.2, "middle": 86400.0, "light": 86400.0}
        assert decision["pause_s"] == pauses, decision
        assert decision["enacted"] and bool(decision["moves"]) == measured, decision


def test_a_manager_restored_from_its_snapshot_goes_on_as_the_first_would():
    """Mid-move (a drain asked, its answer not yet in), the state as JSON and back: the new
    manager answers the rest of the events exactly as the one that never stopped."""
    rest = [("light", {"kind": "drain_agreed", "nodes": ["node2"]}),
            ("light", recovered(["node2"], ["node2"])), ("light", plan(2)),
            ("heavy", plan(3))]
    outs: list[list] = []
    for restart in (False, True):
        m = fleet(lambda kind, **f: None)
        m.start()
        m.on_event("light", recovered([], seconds=0.4))
        m.on_event("heavy", plan(2))
        m.on_event("heavy", recovered(["node2"]))
        assert not m.settled()
        if restart:
            snap = json.loads(json.dumps(m.snapshot()))
            m = fleet(lambda kind, **f: None)
            m.restore(snap)
            assert m.snapshot() == snap
        outs.append([m.on_event(n, e) for n, e in rest] + [m.on_exit("middle", 0, True)]
                    + [m.snapshot()])
    assert outs[0] == outs[1]
    assert outs[0][0] == [Grow("heavy", 1, "light")]


def test_a_refused_drain_cancels_the_move():
    out: list[tuple[str, dict]] = []
    m = fleet(lambda kind, **f: out.append((kind, f)))
    m.start()
    m.on_event("heavy", plan(2))
    m.on_event("heavy", recovered(["node2"]))
    assert m.on_event("light", {"kind": "drain_refused", "nodes": ["node2"],
                                "reason": "no plan"}) == []
    assert m.settled() and [k for k, _ in out][-1] == "fleet_move_failed"


def test_a_waiting_job_starts_when_a_job_ends():
    out: list[tuple[str, dict]] = []
    m = fleet(lambda kind, **f: out.append((kind, f)), pool=6, wait_light=True)
    assert m.start() == [Start("heavy", 3), Start("middle", 2)]  # light needs 4: it waits
    assert m.on_exit("heavy", 0, True) == [Start("light", 4)]


def test_a_job_that_falls_back_waits_and_starts_again_when_nodes_free_up():
    """light (min 2 nodes) loses a node of its 2 and falls back to its checkpoint (exit 75):
    its survivor is free, too few to start it again while heavy and middle keep theirs; when
    middle ends it starts again, its next attempt, on what the pool has."""
    out: list[tuple[str, dict]] = []
    m = fleet(lambda kind, **f: out.append((kind, f)), pool=6)
    m.jobs["light"].min_nodes = 2
    assert m.start() == [Start("heavy", 2), Start("middle", 2), Start("light", 2)]
    assert m.on_event("light", {"kind": "fallback", "nodes": ["node0"]}) == []
    assert m.on_exit("light", 75, False) == []  # (taking a node from heavy or middle: no pay)
    ended = [f for k, f in out if k == "fleet_job_ended"][-1]
    assert ended["requeued"] and m.jobs["light"].state == "waiting" and m.free == 1
    assert m.on_exit("middle", 0, True) == [Start("light", 3, attempt=1)]
    assert m.counts() == {"heavy": 2, "middle": 0, "light": 3} and m.free == 0


def test_a_job_that_falls_back_on_all_its_nodes_starts_again_on_them():
    """A fall back with no plan change before it (no quorum; faults beyond f in one step): the
    job's count is still the one it ran on, and the decision gives it as many again. It must
    start (its target counts from 0: it runs on nothing), not be taken for already there
    (seen in fleet chaos seed 12, trial 0: the fleet ended with the job never started again)."""
    m = fleet(lambda kind, **f: None, pool=6)
    assert m.start() == [Start("heavy", 2), Start("middle", 2), Start("light", 2)]
    assert m.on_exit("light", 75, False) == [Start("light", 2, attempt=1)]
    assert m.counts() == {"heavy": 2, "middle": 2, "light": 2} and m.free == 0


def test_a_job_below_its_min_nodes_after_a_loss_is_stopped_at_its_checkpoint():
    out: list[tuple[str, dict]] = []
    m = fleet(lambda kind, **f: out.append((kind, f)))
    m.jobs["light"].min_nodes = 3
    m.start()
    assert m.on_event("light", plan(2)) == [Stop("light")]
    assert [k for k, _ in out][-1] == "fleet_stop" and m.jobs["light"].stopping
    assert m.on_event("light", recovered(["node1"])) == []  # (asked once; no move meanwhile)
    # stopped: its 2 nodes are free, and one of heavy's (3 -> 2 costs heavy 4 x 2, light on 3
    # gains 12) brings it to its minimum: it starts again once that node left heavy
    assert m.on_exit("light", 75, False) == [Drain("heavy", "node2", "light")]
    assert m.jobs["light"].state == "waiting" and not m.jobs["light"].stopping
    assert m.on_event("heavy", {"kind": "drain_agreed", "nodes": ["node2"]}) == [
        Start("light", 3, attempt=1)]


def test_status_tells_the_managers_events(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", source="fleet")
    m = fleet(log.emit)
    m.start()
    log.emit("fleet_started", fleet="f", pool=8, nodes=m.counts(), waf=m.waf_now(),
             run_dirs={n: str(tmp_path / n) for n in m.jobs})
    for name in m.jobs:
        log.emit("fleet_job_started", job=name, nodes=m.jobs[name].count, run_dir="", pid=1)
    m.on_event("heavy", plan(2))
    m.on_event("heavy", recovered(["node2"]))
    log.close()
    rep = read_status(tmp_path)
    assert rep["jobs"]["heavy"]["nodes_over_time"][-1][1] == 2
    assert rep["jobs"]["heavy"]["state"] == "running"
    assert rep["decisions"][-1]["nodes_after"]["light"] == 2
    assert rep["moves"][0]["move"] == "drain" and rep["waf_now"] == m.waf_now()
    text = format_status(rep)
    assert "drain node2 of light for heavy" in text and "decision: node2 lost in heavy" in text


def test_report_on_a_fleet_run_dir_tells_and_plots_it(tmp_path, capsys):
    """`oobleck-hpc report DIR` on a fleet's run dir is `fleet status`, with its plot."""
    import argparse

    from oobleck_hpc.records.report import main

    log = EventLog(tmp_path / "events.jsonl", source="fleet")
    m = fleet(log.emit)
    m.start()
    log.emit("fleet_started", fleet="f", pool=8, nodes=m.counts(), waf=m.waf_now(),
             run_dirs={n: str(tmp_path / n) for n in m.jobs})
    m.on_event("heavy", plan(2))
    m.on_event("heavy", recovered(["node2"]))
    log.emit("fleet_resumed", pid=1, since_s=2.5, pending=["drain"], jobs={})
    log.close()
    plot = tmp_path / "fleet.png"
    assert main(argparse.Namespace(run_dir=str(tmp_path), run=None, plot=str(plot),
                                   json=False)) == 0
    out = capsys.readouterr().out
    assert "drain node2 of light for heavy" in out and "a new manager (pid 1) took over" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_a_tagged_grow_is_answered_once_and_a_gone_launcher_is_not_waited_for(tmp_path):
    """The manager's grow (launch/local.grow): asked again under its tag (a manager taking
    over repeats it), the launcher's answer is read again, not a second grow; a launcher that
    no longer runs fails the grow at once instead of after its 30 s timeout."""
    import time

    import pytest

    from oobleck_hpc.files import write_json
    from oobleck_hpc.launch.local import GROW_DIR, grow, request_grow

    (tmp_path / "agents.json").write_text("{}")
    request = request_grow(tmp_path, 1, tag="fleet-7")
    write_json(request.with_suffix(".done"), {"nodes": ["node5"]})  # (the launcher's answer)
    request.unlink()
    assert grow(tmp_path, 1, tag="fleet-7") == ["node5"]
    assert grow(tmp_path, 1, tag="fleet-7") == ["node5"]
    assert not list((tmp_path / GROW_DIR).glob("*.request"))  # (never asked twice)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ended before it answered"):
        grow(tmp_path, 1, tag="fleet-8", alive=lambda: False)
    assert time.monotonic() - t0 < 5 and not list((tmp_path / GROW_DIR).glob("*.request"))


def test_a_slurm_jobs_nodes_are_the_ones_its_launcher_started_on():
    """A job of a Slurm fleet runs on the allocation's nodes (its `run_started` names them):
    those are the members a decision drains, not the local launcher's node0, node1, ..."""
    m = fleet(lambda kind, **f: None)
    m.start()
    for name, nodes in (("heavy", ["n1", "n2", "n3"]), ("middle", ["n4", "n5"]),
                        ("light", ["n6", "n7", "n8"])):
        m.on_event(name, {"kind": "run_started", "launch": "slurm-steps", "nodes": len(nodes),
                          "on_nodes": nodes})
    m.on_event("heavy", plan(2))
    assert m.on_event("heavy", recovered(["n2"])) == [Drain("light", "n8", "heavy")]
    m.on_event("middle", {"kind": "run_started", "launch": "local", "nodes": 2, "on_nodes": []})
    assert m.jobs["middle"].members == ["n4", "n5"]  # (a local launcher's names nothing)
