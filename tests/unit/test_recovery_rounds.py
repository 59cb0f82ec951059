"""The recovery rounds' escalation, without processes: which errors end in-place recovery at once
(the checkpoint fallback) and which start another round (recovery/rounds.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from oobleck_hpc.recovery import rounds as recovery  # noqa: E402
from oobleck_hpc.errors import GuaranteeExceeded, PlanningError  # noqa: E402

NODES = ("node0", "node1", "node2", "node3")


class Rounds(recovery.RecoveryRounds):
    """The rounds over a membership that lost node3, every step but planning faked."""

    def __init__(self):
        self.base_plan = SimpleNamespace(nodes=NODES, digest=lambda: "base")
        self.base = SimpleNamespace(release_step_memory=lambda: None)
        self.planned, self.templates, self.profile = None, {}, None
        self.job = SimpleNamespace(fault_tolerance=SimpleNamespace(f=1))
        self.failed_rounds: list[BaseException] = []

    def _agree(self, rec, held):
        return SimpleNamespace(gen=3, nodes=NODES[:3], lost=("node3",), joined=())

    def _round_failed(self, rec, error):
        self.failed_rounds.append(error)
        if len(self.failed_rounds) > 2:
            raise AssertionError(f"rounds retried: {self.failed_rounds}")

    def _teardown(self):
        pass


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
def test_no_plan_for_the_survivors_falls_back_at_once_with_them(planner, error):
    """A survivor set the planner cannot plan is the same on every survivor and in every later
    round: the checkpoint fallback now (naming the survivors for the requeue), no retry."""
    planner.append(error)
    rounds = Rounds()
    rec = recovery.Recovery(7, (), 2, "", 0.0)
    with pytest.raises(GuaranteeExceeded) as caught:
        rounds.rounds(rec, None, "node3 lost")
    assert caught.value.survivors == NODES[:3]
    assert str(error) in str(caught.value)
    assert rounds.failed_rounds == []


def test_a_broken_connection_during_a_round_starts_another(planner):
    planner.append(RuntimeError("connection reset by peer"))
    rounds = Rounds()
    with pytest.raises(AssertionError, match="rounds retried"):
        rounds.rounds(recovery.Recovery(7, (), 2, "", 0.0), None, "node3 lost")
    assert len(rounds.failed_rounds) == 3
