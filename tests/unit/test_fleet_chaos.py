"""`oobleck-hpc fleet chaos`'s draws (operate/fleet_chaos.py): no processes (a campaign runs
the real fleet)."""

from __future__ import annotations

from oobleck_hpc.operate.chaos import KINDS
from oobleck_hpc.operate.fleet_chaos import RESUME_PAUSE_S, draw


def test_trials_are_reproducible_and_every_job_survives_its_faults_in_place():
    counts, fs = {"main": 3, "side": 3, "waits": 0}, {"main": 1, "side": 1, "waits": 1}
    trials = [draw(7, i, counts, fs, 12, list(KINDS), 30.0) for i in range(60)]
    assert trials == [draw(7, i, counts, fs, 12, list(KINDS), 30.0) for i in range(60)]
    assert trials != [draw(8, i, counts, fs, 12, list(KINDS), 30.0) for i in range(60)]
    for t in trials:
        assert t.faults["waits"] == []  # (no nodes at the start: nothing to fault)
        for job, faults in t.faults.items():
            assert len(faults) <= fs[job]  # within f: the job keeps training in place
            assert all(0 <= x.node < counts[job] and 1 <= x.step <= 12 for x in faults)
        assert 1.0 <= t.kill_at_s <= 30.0 and 0.0 <= t.resume_after_s <= RESUME_PAUSE_S
    drawn = {x.kind for t in trials for fs_ in t.faults.values() for x in fs_}
    assert drawn == set(KINDS), drawn  # every fault kind the product offers, drain and grow too
    assert any(not t.faults["main"] for t in trials) and any(t.faults["main"] for t in trials)
