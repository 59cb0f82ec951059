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
