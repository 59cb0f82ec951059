"""A joining node rebuilds its members' base plan (recovery/join.py), without processes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from oobleck_hpc.config import load_job  # noqa: E402
from oobleck_hpc.planning import plan_job  # noqa: E402
from oobleck_hpc.profiling import resolve_profile  # noqa: E402
from oobleck_hpc.recovery import join  # noqa: E402
from oobleck_hpc.recovery.standing import JOINER, Standing  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "examples" / "gpt-tiny-local.yaml"


def test_a_joiner_rebuilds_the_plan_of_a_start_that_lost_a_node():
    """The members started on 3 nodes, lost node2 during the restore and planned afresh on
    node0 and node1: their templates are those of 2 nodes, whose plan the templates of 3 do
    not rebuild (seen in fleet chaos, seed 3201 trial 7: a node grown into such a job fell
    back). The members say their count, and the joiner builds the same templates."""
    job = load_job(DEMO)
    profile = resolve_profile(job)
    members = ("node0", "node1")
    _, _, plan = plan_job(job, profile, list(members))
    said = Standing(plan.digest(), 12, 96, "", tuple(tuple(p.nodes) for p in plan.pipelines),
                    plan.generation, len(members))
    values = {n: [asdict(said)] * job.cluster.gpus_per_node for n in members}
    values["node3"] = [asdict(JOINER)] * job.cluster.gpus_per_node
    s = SimpleNamespace(job=job, profile=profile, agree_s=1.0, fresh=None, client=SimpleNamespace(
        exchange=lambda key, value, timeout, gen: values))
    join.build_templates(s, 3)  # the joiner's guess while it waits: generation 0's 3 nodes

    base = join.joining_base(s, 2)
    assert base.plan.digest() == plan.digest()
    assert (base.state.step, base.state.cursor, s.template_nodes) == (12, 96, 2)
    assert s.fresh == frozenset()


@pytest.mark.parametrize("bad", [
    None, "x", {"step": 3}, {**asdict(JOINER), "step": "3"}, {**asdict(JOINER), "step": True},
    {**asdict(JOINER), "groups": [["node0", 1]]}, {**asdict(JOINER), "groups": "node0"},
    {**asdict(JOINER), "extra": 1}])
def test_a_malformed_standing_is_named_and_falls_back(bad):
    """Every input from a socket is untrusted until validated: a rank's value in the reconcile
    exchange that is not a standing ends in-place recovery with an error naming its node (the
    checkpoint fallback), not a TypeError in the middle of a recovery."""
    from oobleck_hpc.errors import RecoveryError

    good = asdict(Standing("abc", 4, 32, "", (("node0", "node1"),), 1, 2))
    for values in ({"node0": [good], "node1": [good, bad]}, {"node0": [good], "node1": bad}):
        with pytest.raises(RecoveryError, match="node1"):
            Standing.gathered(values)
    assert Standing.gathered({"node0": [good], "node1": [asdict(JOINER)]}) == [
        Standing("abc", 4, 32, "", (("node0", "node1"),), 1, 2)]
