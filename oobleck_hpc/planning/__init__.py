"""Planning: pure arithmetic on profiles (no torch, h5py, mpi4py or submitit).

- `cost.py`         the cost model: every equation the planner optimises, in one place;
- `templates.py`    the exact optimal pipeline for every node count;
- `spec.py`         node specification (n0, template sizes n0..N) with the covering proof;
- `instantiate.py`  templates -> pipelines on named nodes + batch split, exact and polynomial;
- `reconfigure.py`  the plan after node losses, and the state-transfer plan;
- `plan.py`         the plain data every rank reads.

`plan_job(job, profile, nodes)` is what a job calls: every node computes the same bytes.

How a job picks the template objective's `microbatches`: the job's global batch B divided by the
number of pipelines it would run if every pipeline were as small as possible,
``m = max(1, round(B / max(f + 1, N // n0)))`` -- the per-pipeline microbatch count of the
smallest templates, whose bubbles matter most. A pipeline given another count is still costed
exactly by cost.pipeline_iteration_ms (only the in-stage all-reduce share y / m_t keeps m_t).
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import PlanningError
from oobleck_hpc.planning import cost
from oobleck_hpc.planning.instantiate import instantiate
from oobleck_hpc.planning.plan import Plan, Template
from oobleck_hpc.planning.reconfigure import check_reconfigurable
from oobleck_hpc.planning.spec import NodeSpec, node_specification
from oobleck_hpc.planning.templates import build_templates
from oobleck_hpc.profiling.profile import ModelProfile


def template_microbatches(global_microbatches: int, num_nodes: int, n0: int, f: int) -> int:
    pipes = max(f + 1, num_nodes // max(1, n0))
    return max(1, round(global_microbatches / pipes))


def job_templates(job: JobConfig, profile: ModelProfile, num_nodes: int
                  ) -> tuple[NodeSpec, dict[int, Template]]:
    """Node specification and templates of `job` on `num_nodes` nodes (they depend on the count
    only: a node joining a running job rebuilds its members' templates from their count).

    The templates are built from `cost.job_profile(job, profile)`: on a CPU host with more
    workers than cores every time is scaled by the measured core-sharing slowdown (cost.py)."""
    # A CPU host running more workers than cores: each pretend GPU gets a share of a core.
    return _templates(job, cost.job_profile(job, profile), num_nodes)


def _templates(job: JobConfig, profile: ModelProfile, num_nodes: int
               ) -> tuple[NodeSpec, dict[int, Template]]:
    """`job_templates` from the job's profile (`cost.job_profile`), which plan_job keeps."""
    G = profile.machine.gpus_per_node
    if G != job.cluster.gpus_per_node:
        raise PlanningError(f"profile has {G} GPUs per node but the job "
                            f"({job.source}) has cluster.gpus_per_node = {job.cluster.gpus_per_node}")
    f, B = job.fault_tolerance.f, job.train.global_microbatches
    try:
        spec = node_specification(profile, num_nodes, f)
    except PlanningError as e:
        if job.train.recompute:
            raise
        try:  # would activation recomputation make it fit? Then say so.
            node_specification(cost.with_recompute(profile), num_nodes, f)
        except PlanningError:
            raise e from None
        raise PlanningError(f"{e}; or activation recomputation: with train.recompute: true "
                            f"in {job.source} it fits") from None
    m = template_microbatches(B, num_nodes, spec.n0, f)
    return spec, build_templates(profile, spec.template_sizes, m)


def plan_job(job: JobConfig, profile: ModelProfile, nodes: Sequence[str]
             ) -> tuple[NodeSpec, dict[int, Template], Plan]:
    """Node specification, templates (`job_templates`) and the initial plan of `job` on
    `nodes`; PlanningError if some loss of k <= f nodes could not be reconfigured in place
    (reconfigure.py)."""
    profile = cost.job_profile(job, profile)
    spec, templates = _templates(job, profile, len(nodes))
    f, B = job.fault_tolerance.f, job.train.global_microbatches
    if B < f + 1:
        raise PlanningError(f"{job.source}: train.global_microbatches = {B} cannot feed f + 1 = "
                            f"{f + 1} pipelines (each needs at least one). Fix: raise it to >= {f + 1}")
    plan = instantiate(templates, nodes, B, f, profile)
    try:  # every loss of k <= f nodes must reconfigure in place (spec.py, reconfigure.py)
        check_reconfigurable(templates, profile, len(nodes), B, f)
    except PlanningError as e:
        raise PlanningError(f"{job.source}: {e}") from None
    return spec, templates, plan


__all__ = ["plan_job", "job_templates", "template_microbatches", "NodeSpec", "Plan", "Template"]
