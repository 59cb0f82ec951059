"""Policies driven by our own planner and profiles: the answer for any model and cluster.

For a job file (model, nodes, GPUs per node, global batch, f) and its profile (measured, or
analytic for machines we do not have), each policy's backend asks the planner:

oobleck
    throughput = 1 / plan_iteration_ms(plan) of the current plan (templates instantiated on the
    alive nodes). On a failure `reconfigure(plan, lost, templates, profile, f)` gives the new plan
    and its cost:

        cost = detect_s + regroup_s + transfer_s
        transfer_s = max over ranks r of  link(max(bytes into r, bytes out of r))

    with `transfer_plan(old, new)` listing the layers (weights + optimizer state) copied from
    surviving replicas, each rank's transfers serialised on its own link (p2p_intra when source
    and destination share a node, else p2p_inter of the profile's machine), all ranks in
    parallel. The step in flight is replayed (the engine books it as lost). GuaranteeExceeded
    falls back to the last checkpoint and restarts on a fresh plan.

restart (Varuna-like)
    the best *homogeneous* plan on the alive nodes: p copies of one template of t nodes
    (p = floor(n / t), the batch split evenly, the remaining n - p*t nodes idle), t chosen for
    the shortest plan_iteration_ms. Restart = restart_base_s + checkpoint read, checkpoint =
    one copy of all layer state written at `storage_bw` (bytes/s, aggregate), blocking.

redundant (Bamboo-like)
    every node also holds and runs forward for its successor's layers: planned with a profile
    whose layers have forward_ms doubled and state doubled (the redundant copy needs the
    memory). useful = (our plain plan's iteration) / (the redundant plan's iteration) on the same
    nodes. Rebalancing after a failure re-launches the workers on new pipelines (Bamboo measured
    76-450 s, as slow as a restart): restart_base_s + copying the redundant state of one node.

Checkpoint interval (restart, and oobleck's fallback checkpoints): the job's
checkpoint.every_steps / every_minutes when set, else Young/Daly's optimum
tau = sqrt(2 * C * M) for checkpoint cost C and the trace's mean time between failures M.
Oobleck's checkpoints are asynchronous: training blocks only for the snapshot of a rank's state
to host memory (`host_bw`).

Plans depend only on the node count for restart and redundant and are cached per count;
oobleck's plans depend on which nodes failed and are computed per failure (the planner is
arithmetic on profiles and fast).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import GuaranteeExceeded, PlanningError
from oobleck_hpc.planning.plan import PipelineSpec, Plan
from oobleck_hpc.profiling.profile import ModelProfile
from oobleck_hpc.sim.engine import RunConfig


@dataclass(frozen=True)
class CostParams:
    """Constants of the recovery models that no profile measures; every one is a CLI flag."""

    detect_s: float | None = None
    """Failure detection + agreement; default: the job's fault_tolerance.lease_s (a dead node
    is known when its heartbeat lease expires)."""
    regroup_s: float = 2.0
    """Re-forming process groups (measured 0.07-0.19 s with gloo on 4 ranks on this machine;
    NCCL communicators over thousands of GPUs take seconds)."""
    restart_base_s: float = 120.0
    """Restart without the checkpoint read: Slurm requeue/step launch, `import torch`, rendezvous,
    NCCL init (Varuna measured 76 s on 30 nodes for BERT-large, whose checkpoint is small)."""
    storage_bw: float = 20e9
    """Aggregate checkpoint storage bandwidth, bytes/s (a parallel file system's share)."""
    host_bw: float = 10e9
    """Device-to-host copy per GPU, bytes/s (the blocking part of an asynchronous checkpoint)."""


def _samples(job: JobConfig) -> float:
    return float(job.train.global_microbatches * job.train.microbatch_size)


def redundant_profile(profile: ModelProfile) -> ModelProfile:
    """Bamboo's layers: forward computed twice (own + the predecessor's redundant copy), state
    held twice."""
    layers = tuple(dataclasses.replace(l, forward_ms=2 * l.forward_ms,
                                       param_bytes=2 * l.param_bytes,
                                       optimizer_bytes=2 * l.optimizer_bytes)
                   for l in profile.layers)
    return dataclasses.replace(profile, layers=layers)


class PlannerModel:
    """Everything the three planner backends share: job, profile, templates, costs."""

    def __init__(self, job: JobConfig, profile: ModelProfile, params: CostParams | None = None,
                 initial_plan: bool = True):
        from oobleck_hpc.planning import template_microbatches
        from oobleck_hpc.planning.spec import node_specification
        from oobleck_hpc.planning.templates import build_templates

        self.job, self.profile = job, profile
        self.params = params or CostParams()
        n, f = job.cluster.nodes, job.fault_tolerance.f
        self.spec = node_specification(profile, n, f)
        m = template_microbatches(job.train.global_microbatches, n, self.spec.n0, f)
        self.templates = build_templates(profile, self.spec.template_sizes, m)
        if not self.templates:
            raise PlanningError(f"{job.source}: no pipeline template fits {profile.fingerprint.model_name}")
        self.nodes = tuple(f"node{i}" for i in range(n))
        self.initial_plan = self.instantiate(self.nodes) if initial_plan else None
        self.state_bytes = sum(l.state_bytes for l in profile.layers)
        self.detect_s = (self.params.detect_s if self.params.detect_s is not None
                         else job.fault_tolerance.lease_s)
        self._homog = lru_cache(maxsize=None)(self._homogeneous)

    @property
    def samples(self) -> float:
        return _samples(self.job)

    def iteration_s(self, plan: Plan) -> float:
        from oobleck_hpc.planning.cost import plan_iteration_ms

        return plan_iteration_ms(plan, self.profile) / 1000.0

    def run_of(self, plan: Plan, useful: float = 1.0) -> RunConfig:
        sizes = sorted((p.template.num_nodes for p in plan.pipelines), reverse=True)
        label = "+".join(f"{sizes.count(s)}x{s}" for s in sorted(set(sizes), reverse=True))
        return RunConfig(self.iteration_s(plan), self.samples, len(plan.nodes), useful,
                         f"pipelines {label} nodes")

    # ------------------------------------------------------------------ costs

    def transfer_s(self, old: Plan, new: Plan) -> float:
        from oobleck_hpc.planning.reconfigure import transfer_plan

        machine = self.profile.machine
        inbound: dict[int, int] = {}
        outbound: dict[int, int] = {}
        local: dict[int, int] = {}
        for tr in transfer_plan(old, new, self.profile):
            src_node = new.ranks[tr.src_rank].node  # both ranks are numbered in `new`
            dst_node = new.ranks[tr.dst_rank].node
            if src_node == dst_node:
                local[tr.dst_rank] = local.get(tr.dst_rank, 0) + tr.nbytes
            else:
                inbound[tr.dst_rank] = inbound.get(tr.dst_rank, 0) + tr.nbytes
                outbound[tr.src_rank] = outbound.get(tr.src_rank, 0) + tr.nbytes
        worst_ms = 0.0
        for r in set(inbound) | set(outbound):
            worst_ms = max(worst_ms, machine.p2p_inter.time_ms(max(inbound.get(r, 0),
                                                                    outbound.get(r, 0))))
        for r, b in local.items():
            worst_ms = max(worst_ms, machine.p2p_intra.time_ms(b))
        return worst_ms / 1000.0

    def checkpoint_write_s(self) -> float:
        return self.state_bytes / self.params.storage_bw

    def restart_s(self) -> float:
        return self.params.restart_base_s + self.state_bytes / self.params.storage_bw

    def snapshot_s(self, plan: Plan) -> float:
        """Blocking part of an asynchronous checkpoint: the most loaded GPU's state to host."""
        worst = 0
        for pipe in plan.pipelines:
            for stage in pipe.template.stages:
                b = sum(self.profile.layers[i].state_bytes for i in stage.layers)
                worst = max(worst, b // max(len(stage.gpus), 1))
        return worst / self.params.host_bw

    # ------------------------------------------------------------------ plans

    def instantiate(self, nodes: tuple[str, ...]) -> Plan | None:
        """A fresh plan on `nodes` (None when none exists, e.g. fewer than n0 nodes)."""
        from oobleck_hpc.planning.instantiate import instantiate

        try:
            return instantiate(self.templates, nodes, self.job.train.global_microbatches,
                               self.job.fault_tolerance.f, self.profile)
        except (PlanningError, GuaranteeExceeded):
            return None

    def _homogeneous(self, n: int, min_pipelines: int = 1) -> tuple[float, int, int] | None:
        """(iteration_s, template nodes t, pipelines p) of the best homogeneous plan on n nodes
        with at least `min_pipelines` pipelines."""
        best = None
        names = tuple(f"h{i}" for i in range(n))
        m = self.job.train.global_microbatches
        for t, template in sorted(self.templates.items()):
            p = min(n // t, m)
            if p < max(min_pipelines, 1):
                continue
            q, r = divmod(m, p)
            pipes = tuple(PipelineSpec(template, names[i * t:(i + 1) * t], q + (1 if i < r else 0))
                          for i in range(p))
            plan = Plan(pipes, m, 0.0)
            it = self.iteration_s(plan)
            if best is None or it < best[0]:
                best = (it, t, p)
        return best

    def homogeneous(self, n: int, min_pipelines: int = 1) -> RunConfig | None:
        best = self.homogeneous_shape(n, min_pipelines)
        if best is None:
            return None
        it, t, p = best
        return RunConfig(it, self.samples, t * p, 1.0, f"{p}x{t} nodes (homogeneous)")

    def homogeneous_shape(self, n: int, min_pipelines: int = 1) -> tuple[float, int, int] | None:
        """(iteration_s, t, p) of homogeneous(n, min_pipelines) (cached)."""
        return self._homog(n, min_pipelines)


class OobleckBackend:
    """In-place reconfiguration by our planner, cached per node count.

    The first time the job goes from n+1 to n nodes, `reconfigure` runs on the plan it had at
    n+1 with the node that actually failed (for a trace that only loses nodes, this is exactly
    what the job does). That plan, its throughput and the transition's cost are cached by node
    count; a later visit to the same counts (after replacements joined) reuses them, with the
    failed node standing in for the cached plan's node in the same position. So a week at
    16,384 GPUs costs one planner call per distinct node count, not one per failure.
    """

    def __init__(self, model: PlannerModel):
        self.m = model
        self.plans: dict[int, Plan] = {}
        self.runs: dict[int, RunConfig] = {}
        self.steps: dict[tuple[int, int], tuple[int, float] | None] = {}
        if model.initial_plan is not None:
            self.plans[len(model.nodes)] = model.initial_plan
        self.committed_n = len(model.nodes)
        self.tentative_n = self.committed_n

    def _plan_for(self, nodes: tuple[str, ...]) -> Plan | None:
        n = len(nodes)
        if n not in self.plans:
            plan = self.m.instantiate(nodes)
            if plan is None:
                return None
            self.plans[n] = plan
        return self.plans[n]

    def _run(self, n: int) -> RunConfig:
        if n not in self.runs:
            self.runs[n] = self.m.run_of(self.plans[n])
        return self.runs[n]

    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        return None if self._plan_for(nodes) is None else self._run(len(nodes))

    def reset(self, nodes: tuple[str, ...]) -> None:
        if self._plan_for(nodes) is not None:
            self.committed_n = self.tentative_n = len(nodes)

    def commit(self) -> None:
        self.committed_n = self.tentative_n

    def reconfigure(self, lost: tuple[str, ...], alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        from oobleck_hpc.planning.reconfigure import reconfigure

        n_before, k = self.committed_n, len(lost)
        key = (n_before, k)
        if key not in self.steps:
            base = self.plans[n_before]
            victims: list[str] = []
            for i, name in enumerate(lost):
                if name in base.nodes and name not in victims:
                    victims.append(name)
                else:  # a stand-in at a position derived from the name, reproducibly
                    free = [x for x in base.nodes if x not in victims]
                    victims.append(free[sum(map(ord, name)) % len(free)])
            try:
                new = reconfigure(base, victims, self.m.templates, self.m.profile,
                                  self.m.job.fault_tolerance.f)
            except (GuaranteeExceeded, PlanningError):
                self.steps[key] = None
            else:
                n_after = len(new.nodes)
                cost = self.m.detect_s + self.m.params.regroup_s + self.m.transfer_s(base, new)
                self.plans.setdefault(n_after, new)
                self.steps[key] = (n_after, cost)
        step = self.steps[key]
        if step is None:
            raise GuaranteeExceeded(f"losing {k} node(s) of the {n_before}-node plan exceeds "
                                    f"the guarantee (f={self.m.job.fault_tolerance.f}).")
        self.tentative_n = step[0]
        return self._run(step[0]), step[1]

    def grow(self, alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        """Nodes joined: the plan for the new count; each new node receives its layers."""
        plan = self._plan_for(alive)
        if plan is None:
            raise GuaranteeExceeded(f"no plan on {len(alive)} nodes.")
        self.committed_n = self.tentative_n = len(alive)  # a planned transition: commit now
        worst = 0
        for pipe in plan.pipelines:
            for stage in pipe.template.stages:
                worst = max(worst, sum(self.m.profile.layers[i].state_bytes for i in stage.layers))
        cost = self.m.params.regroup_s + self.m.profile.machine.p2p_inter.time_ms(worst) / 1000.0
        return self._run(len(alive)), cost

    def restart_s(self, nodes: int) -> float:
        return self.m.restart_s()


class HomogeneousBackend:
    def __init__(self, model: PlannerModel):
        self.m = model

    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        return self.m.homogeneous(len(nodes))

    def restart_s(self, nodes: int) -> float:
        return self.m.restart_s()


class RedundantBackend:
    def __init__(self, model: PlannerModel):
        self.m = model
        job = model.job
        try:
            self.rm: PlannerModel | None = PlannerModel(job, redundant_profile(model.profile),
                                                        model.params, initial_plan=False)
        except PlanningError:  # the doubled state fits no node count of this job
            self.rm = None
        self._cache: dict[int, RunConfig | None] = {}

    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        n = len(nodes)
        if n not in self._cache:
            red = self.rm.homogeneous(n) if self.rm is not None else None
            plain = self.m.homogeneous(n)
            if red is None or plain is None:
                self._cache[n] = None
            else:
                useful = min(1.0, plain.iteration_s / red.iteration_s)
                self._cache[n] = dataclasses.replace(red, useful=useful,
                                                     label=red.label.replace("homogeneous",
                                                                             "redundant"))
        return self._cache[n]

    def reconfiguration_s(self, nodes: int) -> float:
        per_node = 2 * self.m.state_bytes / max(nodes, 1)
        return (self.m.detect_s + self.m.params.restart_base_s
                + self.m.profile.machine.p2p_inter.time_ms(per_node) / 1000.0)

    def restart_s(self, nodes: int) -> float:
        return self.m.params.restart_base_s + 2 * self.m.state_bytes / self.m.params.storage_bw


def recovery_window_s(backend: OobleckBackend) -> float:
    """A typical in-place reconfiguration: the initial plan losing one node (the result is
    cached in `backend`, so the first real failure reuses it)."""
    nodes = backend.m.nodes
    try:
        _, cost = backend.reconfigure((nodes[0],), nodes[1:])
    except GuaranteeExceeded:
        return backend.m.detect_s + backend.m.params.regroup_s
    backend.tentative_n = backend.committed_n
    return cost


def checkpoint_settings(model: PlannerModel, policy: str, mtbf_s: float,
                        window_s: float | None = None) -> dict:
    """Policy keyword arguments for checkpointing.

    The job's checkpoint.every_steps / every_minutes win when set. Otherwise Young/Daly:
    tau = sqrt(2 * C * M) with C the blocking cost of one checkpoint and M the mean time between
    the failures that need it. restart needs it on every failure (M = the trace's MTBF). oobleck
    and redundant need it only beyond their guarantee: f + 1 failures within one recovery
    window w (f = 1 for redundancy), whose mean interval is M_fb = M^(f+1) / w^f for Poisson
    failures. C: restart and redundant block for the write of one copy of the state;
    oobleck's checkpoints are asynchronous and block only for the snapshot to host memory.
    """
    job = model.job
    write = model.checkpoint_write_s()
    if policy in ("oobleck", "recycle"):  # asynchronous; recycle: f = 0 (sim/recycle.py)
        blocking = model.snapshot_s(model.initial_plan)
        f = job.fault_tolerance.f if policy == "oobleck" else 0
        window = window_s if window_s is not None else model.detect_s + model.params.regroup_s
    elif policy == "redundant":
        blocking, f = write, 1
        window = model.detect_s + model.params.restart_base_s
    else:
        blocking, f, window = write, 0, 1.0
    if job.checkpoint.every_steps:
        return {"checkpoint_s": blocking, "checkpoint_every_steps": job.checkpoint.every_steps}
    if job.checkpoint.every_minutes:
        return {"checkpoint_s": blocking, "checkpoint_interval_s": 60 * job.checkpoint.every_minutes}
    return young_daly(blocking, mtbf_s, window, f)


def young_daly(blocking_s: float, mtbf_s: float, window_s: float, f: int) -> dict:
    """Policy keyword arguments for a checkpoint that blocks `blocking_s`, every
    tau = sqrt(2 * C * M_fb) with M_fb = M^(f+1) / w^f the mean interval between f + 1
    failures inside one recovery window w (checkpoint_settings); none when M is infinite."""
    if not math.isfinite(mtbf_s):
        return {"checkpoint_s": blocking_s}
    m_fb = mtbf_s * (mtbf_s / max(window_s, 1e-3)) ** f
    tau = math.sqrt(2 * max(blocking_s, 1e-3) * m_fb)
    return {"checkpoint_s": blocking_s, "checkpoint_interval_s": tau}


def planner_backends(job: JobConfig, profile: ModelProfile, params: CostParams, mtbf_s: float,
                     policies: tuple[str, ...] = ("oobleck", "restart", "redundant"),
                     ) -> dict[str, tuple[object, dict]]:
    """Per requested policy: its backend and checkpoint settings (Policy keyword arguments)."""
    model = PlannerModel(job, profile, params)
    out: dict[str, tuple[object, dict]] = {}
    for name in policies:
        if name == "oobleck":
            backend = OobleckBackend(model)
            out[name] = (backend, checkpoint_settings(model, name, mtbf_s,
                                                      recovery_window_s(backend)))
        elif name == "restart":
            out[name] = (HomogeneousBackend(model), checkpoint_settings(model, name, mtbf_s))
        elif name == "recycle":
            from oobleck_hpc.sim.recycle import RecycleBackend

            out[name] = (RecycleBackend(model), checkpoint_settings(model, name, mtbf_s))
        else:
            out[name] = (RedundantBackend(model), checkpoint_settings(model, name, mtbf_s))
    return out
