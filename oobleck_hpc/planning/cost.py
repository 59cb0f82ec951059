"""The cost model: what one training step of a plan costs. The ONE place its equations live.

Every number the planner optimises, and every prediction it prints, comes from the functions
below; the engine executes what they describe. Units: milliseconds and bytes.

Notation. A pipeline has stages i = 0 .. S-1; stage i holds layers [a_i, b_i) on k_i GPUs of one
node. Per layer l the profile gives, for one microbatch on one GPU: forward f_l, backward b_l,
gradient bytes g_l, state bytes (params + grads + optimizer), activation bytes kept for backward
act_l, output bytes out_l.

Stage compute (a k-GPU stage splits each microbatch's samples k ways and is data-parallel inside
its node; its first GPU gets ceil(mb / k) of the mb rows and the stage waits for it)::

    f_l(k), b_l(k) = the layer's measured time at ceil(mb / k) rows     (profile schema 2)
                   = f_l / k, b_l / k                                   (analytic / schema 1)
    F_i = sum_l f_l(k_i)
    y_i = sum_l allreduce_ms(intra, g_l, k_i)          in-stage gradient all-reduce, once a step
    o_i = sum_l opt_l                                  the optimizer step (measured), once a step
    B_i = sum_l b_l(k_i) + (y_i + o_i) / m_t           their per-microbatch share (see below)
    t_i = F_i + B_i

`m_t` is the microbatch count the template was built for (`Template.microbatches`); charging the
once-a-step work as a per-microbatch share keeps the objective a sum plus a bottleneck (the
bottleneck stage pays it exactly once over its m_t microbatches; another stage j is charged
(y_j + o_j) / m_t in the fill and drain, a slight over-estimate).

Shared CPU cores (`job_profile`, applied once, in planning.plan_job). A CPU profile is measured
one worker per core; a job whose workers on one host outnumber its cores (the local launcher puts
nodes x gpus_per_node workers on this machine) has every compute time above multiplied by::

    s = max(1, workers_per_host / cores)               (1 on GPUs)

s is a function of the job and the host only (never stored in a profile file) and fixed for the
whole job, so every rank plans with the same number. Communication is not scaled.

Point-to-point between stage i and i+1 (activation forward, gradient back; same size)::

    c_i = link.time_ms(out_{b_i - 1})    link = p2p_intra if both stages share a node else p2p_inter

1F1B iteration of one pipeline with m microbatches (fill + steady state on the bottleneck +
drain)::

    pipe(m) = sum_i t_i + 2 * sum_i c_i + (m - 1) * max_i t_i

Memory per GPU of stage i (must not exceed the device memory)::

    mem_i = sum_l state_l + inflight_i * sum_l act_l / k_i
    inflight_i = min(1 + GPUs of the later stages, 1 + layers after stage i)

Under 1F1B stage i of S holds at most S - i microbatches; S - i - 1 later stages use at least one
GPU and one layer each, so `inflight_i >= S - i` always, with equality when G = 1 (one stage per
node) or when the later stages are single-layer. The bound depends only on the suffix of the
pipeline, which is what makes the template search an exact dynamic programme.

All-reduce (ring over p participants; 2(p-1) steps each moving nbytes/p)::

    allreduce_ms(link, n, p) = 2 (p - 1) * link.time_ms(n / p)          (0 when p < 2)

Gradient synchronisation across pipelines (after the backward pass, every layer's gradient is
all-reduced among the ranks holding it). A ring among P replicas moves 2(P-1)/P * g_l bytes per
rank; we charge its limit 2 * link.time_ms(g_l) per layer, independent of P (within a factor
P/(P-1) of the ring: exact for large P, 2x pessimistic for P = 2). Being independent of P is what
keeps instantiation an exact knapsack (instantiate.py). A pipeline's stage i needs
``sum_{l in i} 2 * p2p_inter.time_ms(g_l)`` (layers reduced one after another, stages in
parallel), so a pipeline of template t reduces in::

    w_t = max_i sum_{l in i} 2 * inter.time_ms(g_l)      (0 for a plan of a single pipeline)

A plan runs its pipelines side by side; pipeline p (template t_p, m_p microbatches) reduces as
soon as it drains, and the step ends with the slowest, then one all-reduce of two numbers (loss,
squared gradient norm) among all R ranks of the plan::

    step = max_p ( pipe_{t_p}(m_p) + w_{t_p} )        plan_iteration_ms, what the planner minimises
    z    = allreduce_ms(allreduce_inter, 16, R)        the same for every plan on the same nodes
    predicted_step_ms = step + z

The link of the cross-pipeline reduction is `allreduce_inter` of the machine (its replicas live
on different nodes).

What the engine executes (engine/engine.py; noted by the engine's author, for the planner to
keep or revise). Stage compute, the row split of a k-GPU stage, point-to-point transfers and
1F1B are as above. Gradient synchronisation differs in two ways: (1) there is no separate
in-stage all-reduce: the layers of a stage are grouped into segments with the same holder set
(`plan.layer_owners`: every replica of the layer in every pipeline, in-node GPUs included) and
each segment is reduced by ONE ring all-reduce over all its holders, started during the last
microbatch's backward. For a single-pipeline plan that ring is y_i (once a step); with several
pipelines its cost is within w_t's per-layer bound, so charging y_i as well over-estimates by
y_i. (2) The latency is paid once per segment, not once per layer. The optimizer step (o_i)
and the cores shared by more ranks than cores (s) are now modelled (above); still not modelled:
one world all-reduce of two numbers (loss, squared norm) per step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from oobleck_hpc.config import JobConfig
from oobleck_hpc.planning.plan import Plan, Template
from oobleck_hpc.profiling.profile import LayerProfile, LinkCost, ModelProfile


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the machine's count otherwise)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def workers_per_host(job: JobConfig) -> int:
    """Worker processes of `job` that share one host: with the local launcher every node agent
    runs on this machine (nodes x gpus_per_node); under Slurm one node is one host."""
    g = job.cluster.gpus_per_node
    return job.cluster.nodes * g if job.cluster.launch == "local" else g


def compute_oversubscription(device_name: str, workers: int, cores: int) -> float:
    """s = max(1, workers / cores) on a CPU device, 1 on a GPU.

    A CPU profile is measured one worker per core (1 torch thread each): each pretend GPU has a
    core to itself. When `workers` processes share `cores` cores and all compute at once, each
    one's compute takes s times longer. Communication is not scaled (measured as is)."""
    if device_name != "cpu" or cores < 1:
        return 1.0
    return max(1.0, workers / cores)


def job_compute_scale(job: JobConfig, profile: ModelProfile, cores: int | None = None) -> float:
    """The oversubscription of `job` on this host for `profile`'s device (see
    compute_oversubscription). Fixed for the whole job (computed from the job's configured
    nodes, not from the survivors), so every rank, in every generation, plans with the same
    number."""
    return compute_oversubscription(profile.machine.device_name, workers_per_host(job),
                                    host_cores() if cores is None else cores)


def job_profile(job: JobConfig, profile: ModelProfile, cores: int | None = None) -> ModelProfile:
    """The profile the planner uses for `job` on this host: compute scaled by job_compute_scale."""
    return scale_compute(profile, job_compute_scale(job, profile, cores))


def scale_compute(profile: ModelProfile, factor: float) -> ModelProfile:
    """`profile` with every layer's compute times multiplied by `factor` (1 returns it as is).
    Applied where the job is planned (planning.plan_job), never written to a profile file."""
    if factor == 1.0:
        return profile
    layers = tuple(replace(x, forward_ms=x.forward_ms * factor, backward_ms=x.backward_ms * factor,
                           optimizer_ms=x.optimizer_ms * factor,
                           forward_rows_ms=tuple(v * factor for v in x.forward_rows_ms),
                           backward_rows_ms=tuple(v * factor for v in x.backward_rows_ms))
                   for x in profile.layers)
    return replace(profile, layers=layers)


def allreduce_ms(link: LinkCost, nbytes: float, participants: int) -> float:
    """Ring all-reduce of `nbytes` among `participants`: 2(p-1) steps of nbytes/p each."""
    p = int(participants)
    if p < 2 or nbytes <= 0:
        return 0.0
    return 2.0 * (p - 1) * link.time_ms(nbytes / p)


def cross_allreduce_ms(link: LinkCost, nbytes: float) -> float:
    """Per-layer cost of the cross-pipeline gradient all-reduce, independent of the number of
    replicas: the ring's limit 2 * (latency + bytes / bandwidth)."""
    if nbytes <= 0:
        return 0.0
    return 2.0 * link.time_ms(nbytes)


def pipeline_iteration_ms(template: Template, microbatches: int) -> float:
    """1F1B time of one pipeline of `template` running `microbatches` microbatches."""
    if microbatches < 1:
        return 0.0
    t = [f + b for f, b in zip(template.stage_forward_ms, template.stage_backward_ms)]
    return sum(t) + 2.0 * sum(template.send_ms) + (microbatches - 1) * max(t)


def layer_compute_ms(layer: LayerProfile, k: int, microbatch_size: int) -> tuple[float, float]:
    """(f_l(k), b_l(k)): forward and backward of one layer on one GPU of a k-GPU stage.

    The engine gives the first GPU of the stage ceil(mb / k) rows (schedule.split_rows), and the
    stage waits for it: the measured time at that row count when the profile has it
    (`forward_rows_ms`, schema 2), else the ideal split f_l / k, b_l / k (analytic profiles)."""
    rows = -(-microbatch_size // k)
    if k > 1 and 1 <= rows <= min(len(layer.forward_rows_ms), len(layer.backward_rows_ms)):
        return layer.forward_rows_ms[rows - 1], layer.backward_rows_ms[rows - 1]
    return layer.forward_ms / k, layer.backward_ms / k


def stage_forward_ms(profile: ModelProfile, start: int, end: int, k: int) -> float:
    """F_i: forward of layers [start, end) on k GPUs sharing each microbatch's samples."""
    mb = profile.fingerprint.microbatch_size
    return sum(layer_compute_ms(profile.layers[l], k, mb)[0] for l in range(start, end))


def stage_optimizer_ms(profile: ModelProfile, start: int, end: int) -> float:
    """o_i: the optimizer step over the stage's layers (every GPU of the stage holds them all)."""
    return sum(profile.layers[l].optimizer_ms for l in range(start, end))


def stage_allreduce_ms(profile: ModelProfile, start: int, end: int, k: int) -> float:
    """y_i: the in-node gradient all-reduce of a k-GPU stage, layer by layer."""
    link = profile.machine.allreduce_intra
    return sum(allreduce_ms(link, profile.layers[l].grad_bytes, k) for l in range(start, end))


def stage_backward_ms(profile: ModelProfile, start: int, end: int, k: int,
                      microbatches: int) -> float:
    """B_i: backward on k GPUs plus the per-microbatch share of the once-a-step work: the
    in-stage all-reduce and the optimizer step."""
    mb = profile.fingerprint.microbatch_size
    back = sum(layer_compute_ms(profile.layers[l], k, mb)[1] for l in range(start, end))
    once = stage_allreduce_ms(profile, start, end, k) + stage_optimizer_ms(profile, start, end)
    return back + once / max(1, microbatches)


def inflight_bound(gpus_after: int, layers_after: int) -> int:
    """Microbatches a stage holds under 1F1B, bounded from the pipeline's suffix (see above)."""
    return 1 + min(gpus_after, layers_after)


def stage_memory_bytes(profile: ModelProfile, start: int, end: int, k: int, inflight: int) -> int:
    """Peak bytes on one GPU of a k-GPU stage: all of its layers' state plus `inflight`
    microbatches of activations (each GPU keeps 1/k of every microbatch's samples)."""
    layers = profile.layers[start:end]
    state = sum(x.param_bytes + x.grad_bytes + x.optimizer_bytes for x in layers)
    act = sum(x.activation_bytes for x in layers)
    return state + -(-inflight * act // k)


def stage_fits(profile: ModelProfile, start: int, end: int, k: int, inflight: int) -> bool:
    """mem_i <= device memory, in exact integer arithmetic (k * state + inflight * act <= k * M)."""
    layers = profile.layers[start:end]
    state = sum(x.param_bytes + x.grad_bytes + x.optimizer_bytes for x in layers)
    act = sum(x.activation_bytes for x in layers)
    return k * state + inflight * act <= k * profile.machine.device_memory_bytes


def send_ms(profile: ModelProfile, last_layer: int, same_node: bool) -> float:
    """c_i: the activation of `last_layer` to the next stage (the gradient back costs the same)."""
    m = profile.machine
    link = m.p2p_intra if same_node else m.p2p_inter
    return link.time_ms(profile.layers[last_layer].output_bytes)


def stage_sync_ms(profile: ModelProfile, layers: Sequence[int]) -> float:
    """Cross-pipeline gradient reduction of one stage's layers (run one after another)."""
    link = profile.machine.allreduce_inter
    return sum(cross_allreduce_ms(link, profile.layers[l].grad_bytes) for l in layers)


def template_sync_ms(template: Template, profile: ModelProfile) -> float:
    """w_t: the slowest stage's cross-pipeline gradient reduction."""
    return max(stage_sync_ms(profile, s.layers) for s in template.stages)


def plan_iteration_ms(plan: Plan, profile: ModelProfile) -> float:
    """Predicted step time of a plan: max over pipelines of (1F1B time + its gradient reduction);
    a plan with a single pipeline has no cross-pipeline reduction."""
    single = len(plan.pipelines) == 1
    worst = 0.0
    sync_cache: dict[int, float] = {}
    for p in plan.pipelines:
        key = id(p.template)
        if key not in sync_cache:
            sync_cache[key] = 0.0 if single else template_sync_ms(p.template, profile)
        worst = max(worst, pipeline_iteration_ms(p.template, p.microbatches) + sync_cache[key])
    return worst


STATS_BYTES = 16
"""The engine's per-step world all-reduce: (loss sum, squared gradient norm) in float64."""


def step_stats_ms(profile: ModelProfile, ranks: int) -> float:
    """z: the per-step all-reduce of STATS_BYTES over every rank of the plan (ring equation)."""
    return allreduce_ms(profile.machine.allreduce_inter, STATS_BYTES, ranks)


def predicted_step_ms(plan: Plan, profile: ModelProfile) -> float:
    """What one engine step of `plan` takes: plan_iteration_ms + z (the statistics all-reduce
    after every pipeline has reduced its gradients). z depends only on the number of ranks,
    which is the same for every candidate plan on the same nodes, so the planner optimises
    plan_iteration_ms alone and loses nothing."""
    ranks = sum(p.template.num_nodes for p in plan.pipelines) * profile.machine.gpus_per_node
    return plan_iteration_ms(plan, profile) + step_stats_ms(profile, ranks)


def samples_per_second(plan: Plan, microbatch_size: int, iteration_ms: float) -> float:
    if iteration_ms <= 0:
        return 0.0
    return plan.global_microbatches * microbatch_size * 1000.0 / iteration_ms
