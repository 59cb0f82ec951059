"""Each job's WAF curve: weight x achieved FLOP/s on n nodes, n = 0..N, as its planner predicts.

Throughput on n nodes is the simulator's (sim/planner_backend.PlannerModel): the job's
templates are built once, for the largest count it may get (min(N, max_nodes)), and
instantiated on every n from 1 up; samples/s = the global batch / the plan's iteration time
(planning/cost.plan_iteration_ms). Where instantiation finds no plan (fewer nodes than f+1
pipelines of the smallest template need) the curve is 0. The profile is the one
`oobleck-hpc plan` uses (profiling.resolve_profile: the library, or analytic).

FLOP/s = samples/s x the model's training FLOPs per sample (profiling/analytic.py's counts:
forward + backward, the "model FLOPs" of MFU), so jobs of different models weigh alike: a
node is worth what it computes, whatever the model.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import ConfigError, PlanningError
from oobleck_hpc.fleet.config import FleetJob


@dataclass(frozen=True)
class Curve:
    """One job's predicted throughput for every node count, and what weighs it."""

    name: str
    weight: float
    flops_per_sample: float
    samples_per_s: np.ndarray
    """samples/s on n nodes, n = 0..len-1; 0 where the planner has no plan."""
    seconds: float
    """Time taken to build it (profile, templates, every instantiation)."""

    @property
    def flops_per_s(self) -> np.ndarray:
        return self.samples_per_s * self.flops_per_sample

    @property
    def waf(self) -> np.ndarray:
        return self.weight * self.flops_per_s

    @property
    def smallest(self) -> int | None:
        """The fewest nodes with a plan (None: none up to the curve's end)."""
        runs = np.flatnonzero(self.samples_per_s > 0)
        return int(runs[0]) if len(runs) else None


def flops_per_sample(job: JobConfig) -> float:
    """The job's model's training FLOPs per sample, at its sequence length."""
    from oobleck_hpc.profiling.analytic import training_flops_per_sample

    if job.model.factory is not None:
        raise ConfigError(job.source, "model.factory", f"value {job.model.factory!r} is a model "
                          "whose FLOPs per sample the fleet cannot count",
                          "use a built-in model (model.name) or a Hugging Face config (model.hf) "
                          "in a fleet")
    model: object = job.model.name
    if job.model.hf is not None:
        from oobleck_hpc.models.hf_config import hf_arch

        model = hf_arch(job.model.hf, job.source)
    return training_flops_per_sample(model, job.data.seq_len)  # type: ignore[arg-type]


def samples_per_s(job: JobConfig, top: int) -> np.ndarray:
    """samples/s of `job` on n = 0..top nodes (module docstring)."""
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.sim.planner_backend import PlannerModel

    out = np.zeros(top + 1)
    if top < 1:
        return out
    sized = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, nodes=top))
    profile = resolve_profile(sized)
    try:
        model = PlannerModel(sized, profile, initial_plan=False)
    except PlanningError as e:
        raise PlanningError(f"{job.source}: no plan on up to {top} nodes: {e}") from None
    for n in range(1, top + 1):
        plan = model.instantiate(model.nodes[:n])
        if plan is not None:
            out[n] = model.run_of(plan).samples_per_s
    return out


def job_curve(fleet_job: FleetJob, nodes: int) -> Curve:
    """The curve of one fleet job on a pool of `nodes` (up to its max_nodes)."""
    t0 = time.perf_counter()
    entry = fleet_job.entry
    top = nodes if entry.max_nodes is None else min(nodes, entry.max_nodes)
    sps = samples_per_s(fleet_job.job, top)
    return Curve(fleet_job.name, entry.weight, flops_per_sample(fleet_job.job), sps,
                 time.perf_counter() - t0)
