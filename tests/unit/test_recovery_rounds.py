"""The recovery rounds' escalation, without processes: which errors end in-place recovery at once
(the checkpoint fallback) and which start another round (recovery/rounds.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from oobleck_hpc.recovery import rounds as recovery  # noqa: E402
from oobleck_hpc.errors import GuaranteeExceeded, PlanningError  # noqa: E402

NODES = ("node0", "node1", "node2", "node3")


def driver_state():
    """A driver state over a membership that lost node3, only what planning reads."""
    return SimpleNamespace(
        base_plan=SimpleNamespace(nodes=NODES, digest=lambda: "base"),
        base=SimpleNamespace(release_step_memory=lambda: None),
        planned=None, templates={}, profile=None, retries=0,
        job=SimpleNamespace(fault_tolerance=SimpleNamespace(f=1)))


@pytest.fixture
def failed_rounds(monkeypatch):
    """The rounds' other phases faked: agreement on the survivors of node3's loss, and each
    failed round recorded (three mean the rounds retried)."""
    failed: list[BaseException] = []

    def round_failed(s, rec, error):
        failed.append(error)
        if len(failed) > 2:
            raise AssertionError(f"rounds retried: {failed}")

    monkeypatch.setattr(recovery, "agree", lambda s, rec, held: SimpleNamespace(
        gen=3, nodes=NODES[:3], lost=("node3",), joined=()))
    monkeypatch.setattr(recovery, "round_failed", round_failed)
    monkeypatch.setattr(recovery, "teardown", lambda s: None)
    return failed


@pytest.fixture
def planner(monkeypatch):
    """reconfigure() raising what the test sets."""
    from oobleck_hpc.planning import cost, reconfigure

    raised: list[BaseException] = []

    def fake_reconfigure(*args, **kwargs):
        raise raised[0]

    monkeypatch.setattr(reconfigure, "reconfigure", fake_reconfigure)
    monkeypatch.setattr(cost, "job_profile", lambda job, profile: None)
    return raised


@pytest.mark.parametrize("error", [PlanningError("no plan covers the 3 survivors"),
                                   GuaranteeExceeded("layer 4 has no surviving replica")])
def test_no_plan_for_the_survivors_falls_back_at_once_with_them(planner, failed_rounds, error):
    """A survivor set the planner cannot plan is the same on every survivor and in every later
    round: the checkpoint fallback now (naming the survivors for the requeue), no retry."""
    planner.append(error)
    rec = recovery.Recovery(7, (), 2, "", 0.0)
    with pytest.raises(GuaranteeExceeded) as caught:
        recovery.run_rounds(driver_state(), rec, None, "node3 lost")
    assert caught.value.survivors == NODES[:3]
    assert str(error) in str(caught.value)
    assert failed_rounds == []


def test_a_broken_connection_during_a_round_starts_another(planner, failed_rounds):
    planner.append(RuntimeError("connection reset by peer"))
    with pytest.raises(AssertionError, match="rounds retried"):
        recovery.run_rounds(driver_state(), recovery.Recovery(7, (), 2, "", 0.0), None,
                            "node3 lost")
    assert len(failed_rounds) == 3
