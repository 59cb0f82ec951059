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

Shared CPU cores (`job_profile`, applied once, in planning.plan_job). A profile describes one
worker per core; the local launcher puts nodes x gpus_per_node workers on this one host, often
more than it has cores. They then share the cores (processor sharing): every process -- its
compute and the CPU work of its communication alike (gloo's transfers and reductions run on the
same cores) -- runs s times slower, so EVERY time of the profile (compute, optimizer, link
latencies; bandwidths divided) is multiplied by::

    s = host_slowdown(W workers on C cores) = core_sharing(W / C)        (1 on GPUs, or W <= C)

where `core_sharing` is the table the profiler measured on this kind of host (k workers per core,
all running the model: k x a measured overhead of context switches and caches, e.g. 4.8-5.2 at
k = 4 on 2 cores), interpolated linearly in W / C and extended proportionally past its last entry;
W / C when the profile has no table. s depends only on the job and the host (never stored in a
profile file) and is fixed for the whole job. Scaling every time by one factor changes no
comparison between plans: the plan is the one the unscaled profile gives, only its predicted
time grows. What this leaves out (measured on a 2-vCPU KVM machine; bench/engine.py): it
assumes every worker busy for the whole step, so a plan with one microbatch per pipeline, whose
workers mostly wait, runs faster than predicted (the demo: ~51 ms measured, 66 ms predicted);
and it charges a message its idle-host latency (0.06 ms), while two processes that compute
between gloo exchanges lose ~2.3 ms per exchange there (bench/exchange.py; over a
multiprocessing Pipe 0.2 ms), so pipelined plans with many microbatches run 15-35 % slower than
predicted.

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

Gradient synchronisation across pipelines, as the planner searches it (after the backward pass,
every layer's gradient is all-reduced among the ranks holding it). A ring among P replicas moves
2(P-1)/P * g_l bytes per rank; we charge its limit 2 * link.time_ms(g_l) per layer, independent
of P. Being independent of P is what keeps instantiation an exact knapsack (instantiate.py). A
pipeline's stage i needs ``sum_{l in i} 2 * allreduce_inter.time_ms(g_l)``, so a pipeline of
template t reduces in::

    w_t = max_i sum_{l in i} 2 * inter.time_ms(g_l)      (0 for a plan of a single pipeline)

    plan_iteration_ms = max_p ( pipe_{t_p}(m_p) + w_{t_p} )       what the planner minimises

What the engine executes (engine/engine.py), and what `predicted_step_ms` charges for a chosen
plan: a rank's layers are grouped into segments of consecutive layers with the same holder set
(`plan.layer_owners`: every replica of the layer in every pipeline, in-stage GPUs included), and
each segment is reduced by ONE ring all-reduce over its holders (there is no separate in-stage
all-reduce: y_i is part of that ring)::

    sync_r = sum_{segments of rank r} allreduce_ms(link, bytes of the segment, holders)
             link = allreduce_intra if every holder is on one node else allreduce_inter
    pipe'  = pipe(m) with t_i' = F_i + sum_l b_l(k_i)    (no y_i, no o_i share)
    step   = max_r ( pipe'_{t_p(r)}(m_p(r)) + sync_r )
    z      = allreduce_ms(allreduce_inter, 16, R)     one world all-reduce of (loss, squared norm)
    predicted_step_ms = step + z + max_r o_r          then every rank's optimizer step at once

The objective (w_t, y_i and o_i as per-microbatch shares) ranks plans exactly and cheaply; the
prediction evaluates the plan that was chosen the way the engine runs it.

Activation recomputation (`train.recompute`; `with_recompute`, applied in `job_profile`): a layer
keeps only its input for backward, and its backward first runs its forward again::

    act_l' = out_{l-1}   (layer 0: act_0, its token ids)      b_l' = b_l + f_l
    M'     = M - max_l act_l                  the recomputed layer's activations, transiently

The recomputed forward re-creates one layer's activations at a time while its backward runs:
the largest layer's act_l is reserved on every GPU (a slight over-estimate on a k-GPU stage,
which holds 1/k of it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from oobleck_hpc.config import JobConfig
from oobleck_hpc.planning.plan import Plan, Template
from oobleck_hpc.profiling.profile import LayerProfile, LinkCost, MachineProfile, ModelProfile


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


def host_slowdown(machine: MachineProfile, workers: int, cores: int) -> float:
    """s: how many times longer everything takes when `workers` single-threaded processes share
    `cores` cores (see the module docstring); 1 on a GPU or when every worker has a core."""
    if machine.device_name != "cpu" or cores < 1 or workers <= cores:
        return 1.0
    r = workers / cores
    table = (1.0,) + tuple(machine.core_sharing)  # table[k] = k workers per core (k >= 1)
    if len(table) < 2:
        return r
    k = int(r)
    if k >= len(table) - 1:
        return table[-1] * r / (len(table) - 1)
    return table[k] + (r - k) * (table[k + 1] - table[k])


def job_slowdown(job: JobConfig, profile: ModelProfile, cores: int | None = None) -> float:
    """s for `job` on this host (host_slowdown). Fixed for the whole job (computed from the
    job's configured nodes, not from the survivors), so every rank, in every generation, plans
    with the same number."""
    return host_slowdown(profile.machine, workers_per_host(job),
                         host_cores() if cores is None else cores)


def sharing_note(job: JobConfig, profile: ModelProfile, cores: int | None = None) -> str:
    """The host's core sharing in plain words ('' when every worker has a core of its own)."""
    s = job_slowdown(job, profile, cores)
    if s <= 1.0:
        return ""
    cores = host_cores() if cores is None else cores
    return (f"{workers_per_host(job)} workers share {cores} CPU cores here, so every predicted "
            f"time is {s:.2f}x that of one worker per core")


def job_profile(job: JobConfig, profile: ModelProfile, cores: int | None = None) -> ModelProfile:
    """The profile the planner uses for `job` on this host: every time scaled by job_slowdown,
    and activation recomputation accounted for when the job asks for it."""
    if job.train.recompute:
        profile = with_recompute(profile)
    return scale_times(profile, job_slowdown(job, profile, cores))


def with_recompute(profile: ModelProfile) -> ModelProfile:
    """`profile` under activation recomputation (module docstring): each layer keeps its input
    only, backward pays one more forward, the largest layer's activations are reserved."""
    old = profile.layers
    layers = tuple(replace(
        x, activation_bytes=x.activation_bytes if l == 0 else old[l - 1].output_bytes,
        backward_ms=x.backward_ms + x.forward_ms,
        backward_rows_ms=tuple(b + f for b, f in zip(x.backward_rows_ms, x.forward_rows_ms)))
        for l, x in enumerate(old))
    m = profile.machine
    reserve = max(x.activation_bytes for x in old)
    return replace(profile, layers=layers,
                   machine=replace(m, device_memory_bytes=m.device_memory_bytes - reserve))


def scale_times(profile: ModelProfile, factor: float) -> ModelProfile:
    """`profile` with every time multiplied by `factor`: layers' compute and optimizer times,
    link latencies (bandwidths divided). 1 returns it as is. Applied where the job is planned
    (planning.plan_job), never written to a profile file."""
    if factor == 1.0:
        return profile
    layers = tuple(replace(x, forward_ms=x.forward_ms * factor, backward_ms=x.backward_ms * factor,
                           optimizer_ms=x.optimizer_ms * factor,
                           forward_rows_ms=tuple(v * factor for v in x.forward_rows_ms),
                           backward_rows_ms=tuple(v * factor for v in x.backward_rows_ms))
                   for x in profile.layers)
    m = profile.machine

    def scaled(link: LinkCost) -> LinkCost:
        return LinkCost(link.latency_ms * factor, link.bandwidth / factor)

    machine = replace(m, p2p_intra=scaled(m.p2p_intra), p2p_inter=scaled(m.p2p_inter),
                      allreduce_intra=scaled(m.allreduce_intra),
                      allreduce_inter=scaled(m.allreduce_inter))
    return replace(profile, layers=layers, machine=machine)


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


def one_f_one_b_ms(stage_ms: Sequence[float], send_ms: Sequence[float],
                   microbatches: int) -> float:
    """pipe(m): fill and drain through every stage and transfer, then the bottleneck stage once
    for each further microbatch (0 for no microbatches)."""
    if microbatches < 1:
        return 0.0
    return sum(stage_ms) + 2.0 * sum(send_ms) + (microbatches - 1) * max(stage_ms)


def pipeline_iteration_ms(template: Template, microbatches: int) -> float:
    """1F1B time of one pipeline of `template` running `microbatches` microbatches."""
    t = [f + b for f, b in zip(template.stage_forward_ms, template.stage_backward_ms)]
    return one_f_one_b_ms(t, template.send_ms, microbatches)


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


def rank_sync_ms(plan: Plan, profile: ModelProfile) -> list[float]:
    """sync_r for every rank r: the ring all-reduces of its segments (runs of consecutive layers
    with the same holder set), as the engine executes them; a segment held by one rank costs 0."""
    holders: list[list[int]] = [[] for _ in range(plan.num_layers)]
    for info in plan.ranks:  # ascending rank: every holder list comes out sorted
        for layer in range(info.layer_start, info.layer_end):
            holders[layer].append(info.rank)
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    owners = [canonical.setdefault(tuple(h), tuple(h)) for h in holders]  # equal sets: one object
    m = profile.machine
    cache: dict[tuple[int, int], float] = {}

    def ring(seg: tuple[int, ...], nbytes: int) -> float:
        key = (id(seg), nbytes)
        if key not in cache:
            one_node = len({plan.ranks[r].node for r in seg}) == 1
            cache[key] = allreduce_ms(m.allreduce_intra if one_node else m.allreduce_inter,
                                      nbytes, len(seg))
        return cache[key]

    out = []
    for info in plan.ranks:
        total, seg, nbytes = 0.0, owners[info.layer_start], 0
        for layer in range(info.layer_start, info.layer_end):
            if owners[layer] is not seg:
                total += ring(seg, nbytes)
                seg, nbytes = owners[layer], 0
            nbytes += profile.layers[layer].grad_bytes
        out.append(total + ring(seg, nbytes))
    return out


def executed_pipeline_ms(template: Template, microbatches: int, profile: ModelProfile) -> float:
    """pipe(m) with the stage times the engine runs between transfers: F_i and the backward
    alone (the in-stage all-reduce is part of the segments' rings, the optimizer runs once after
    the step's statistics; see predicted_step_ms)."""
    mb = profile.fingerprint.microbatch_size
    t = [f + sum(layer_compute_ms(profile.layers[l], len(st.gpus), mb)[1]
                 for l in range(st.layer_start, st.layer_end))
         for f, st in zip(template.stage_forward_ms, template.stages)]
    return one_f_one_b_ms(t, template.send_ms, microbatches)


def predicted_step_ms(plan: Plan, profile: ModelProfile,
                      slowdown: Mapping[str, float] | None = None) -> float:
    """What one engine step of `plan` takes, as the engine executes it (module docstring):
    every rank's pipeline plus its segments' all-reduces, the slowest of them, then the
    statistics all-reduce z and the optimizer step (every rank at once, its own layers).
    `profile` is the one the plan's templates were built from (`job_profile`). `slowdown`:
    node -> factor its computations take longer (a straggler, recovery/straggler.py); a pipeline
    runs at the pace of its slowest node."""
    slowdown = slowdown or {}
    pipe = [executed_pipeline_ms(p.template, p.microbatches, profile)
            * max(slowdown.get(n, 1.0) for n in p.nodes) for p in plan.pipelines]
    sync = rank_sync_ms(plan, profile)
    step = max(pipe[info.pipeline] + sync[info.rank] for info in plan.ranks)
    optimizer = max(stage_optimizer_ms(profile, info.layer_start, info.layer_end)
                    for info in plan.ranks)
    return step + step_stats_ms(profile, plan.world_size) + optimizer


def samples_per_second(plan: Plan, microbatch_size: int, iteration_ms: float) -> float:
    if iteration_ms <= 0:
        return 0.0
    return plan.global_microbatches * microbatch_size * 1000.0 / iteration_ms
