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


def test_a_share_of_the_faulted_jobs_goes_beyond_f_where_it_can():
    """--beyond-share: f + 1 or more faults (the job may fall back and be requeued in the
    fleet), only where the job has more than f + 1 nodes; one node always survives."""
    counts, fs = {"main": 3, "side": 2}, {"main": 1, "side": 1}
    trials = [draw(7, i, counts, fs, 12, list(KINDS), 30.0, beyond_share=0.5) for i in range(60)]
    beyond = [t for t in trials if len(t.faults["main"]) > 1]
    assert beyond and all(len(t.faults["main"]) <= 2 for t in beyond)
    assert all(len(t.faults["side"]) <= 1 for t in trials)  # (2 nodes: f + 1, never beyond)
    assert any(0 < len(t.faults["main"]) <= 1 for t in trials)


def test_fleet_chaos_says_what_a_bad_share_is(capsys):
    from pathlib import Path

    from oobleck_hpc import cli

    example = Path(__file__).parents[2] / "examples" / "fleet-chaos-local.yaml"
    assert cli.main(["fleet", "chaos", str(example), "--beyond-share", "1.5"]) == 2
    assert "--beyond-share" in capsys.readouterr().err
