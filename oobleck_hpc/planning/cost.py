"""The cost model: what one training step of a plan costs. The ONE place its equations live.

Every number the planner optimises, and every prediction it prints, comes from the functions
below; the engine executes what they describe. Units: milliseconds and bytes.

Notation. A pipeline has stages i = 0 .. S-1; stage i holds layers [a_i, b_i) on k_i GPUs of one
node. Per layer l the profile gives, for one microbatch on one GPU: forward f_l, backward b_l,
gradient bytes g_l, state bytes (params + grads + optimizer), activation bytes kept for backward
act_l, output bytes out_l.

Stage compute (a k-GPU stage splits each microbatch's samples k ways and is data-parallel inside
its node)::

    F_i = sum_l f_l / k_i
    y_i = sum_l allreduce_ms(intra, g_l, k_i)          in-stage gradient all-reduce, once a step
    B_i = sum_l b_l / k_i + y_i / m_t                  its per-microbatch share (see below)
    t_i = F_i + B_i

`m_t` is the microbatch count the template was built for (`Template.microbatches`); charging the
in-stage all-reduce as a per-microbatch share keeps the objective a sum plus a bottleneck (the
bottleneck stage pays it exactly once over its m_t microbatches).

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
soon as it drains, and the step ends with the slowest::

    step = max_p ( pipe_{t_p}(m_p) + w_{t_p} )

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
y_i. (2) The latency is paid once per segment, not once per layer. Not modelled at all: the
optimizer step, one world all-reduce of two numbers (loss, squared norm) per step, and -- on a
CPU machine running more ranks than cores -- the ranks' compute sharing the cores.
"""

from __future__ import annotations

from collections.abc import Sequence

from oobleck_hpc.planning.plan import Plan, Template
from oobleck_hpc.profiling.profile import LinkCost, ModelProfile


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


def stage_forward_ms(profile: ModelProfile, start: int, end: int, k: int) -> float:
    """F_i: forward of layers [start, end) on k GPUs sharing each microbatch's samples."""
    return sum(profile.layers[l].forward_ms for l in range(start, end)) / k


def stage_allreduce_ms(profile: ModelProfile, start: int, end: int, k: int) -> float:
    """y_i: the in-node gradient all-reduce of a k-GPU stage, layer by layer."""
    link = profile.machine.allreduce_intra
    return sum(allreduce_ms(link, profile.layers[l].grad_bytes, k) for l in range(start, end))


def stage_backward_ms(profile: ModelProfile, start: int, end: int, k: int,
                      microbatches: int) -> float:
    """B_i: backward on k GPUs plus the per-microbatch share of the in-stage all-reduce."""
    back = sum(profile.layers[l].backward_ms for l in range(start, end)) / k
    return back + stage_allreduce_ms(profile, start, end, k) / max(1, microbatches)


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


def samples_per_second(plan: Plan, microbatch_size: int, iteration_ms: float) -> float:
    if iteration_ms <= 0:
        return 0.0
    return plan.global_microbatches * microbatch_size * 1000.0 / iteration_ms
