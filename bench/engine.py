"""Engine speed: steady-state step time of our engine vs the single-process reference doing the
same math, vs torch DDP on a pure data-parallel plan, and the planner's predicted step time vs
the measured one. All in ONE pool of worker processes (the same processes run every case).

    python bench/engine.py [--json] [--job examples/gpt-tiny-local.yaml] [--steps 12]

The job file gives the model and optimizer; the benchmark sets its own sizes (--nodes 4,
--global-microbatches 16, no injected faults). Cases (nodes x gpus_per_node ranks):
- "planner": the plan `planning.plan_job` computes for the job's nodes (when the planner exists);
- "hetero":  a hand-made plan with pipelines of different templates (one with a 2-GPU stage),
             its templates' times computed by the planner's cost model (templates.make_template);
- "two_stage": every node runs a 1-node, 2-stage template (layers halved), batch split evenly;
- "pure_dp": one single-stage 2-GPU template per node (every rank holds the whole model);
             also timed under torch DDP with the same global batch and optimizer (a Hugging
             Face job: the plain transformers model under DDP, HFModel.whole_model).

Steady state: the first `--warmup` steps are dropped; a step's time is the slowest rank's
(ranks leave the step together: the final all-reduce is a barrier); the median is reported.
Data: the job's corpus (memory-mapped token file, re-mapped by every worker).

Keys of --json (top level = the job's configuration, the planner's plan): engine_step_s,
reference_step_s, ratio (engine / reference), predicted_step_s (cost.predicted_step_ms: the
planner's step time for this job on this host, every time scaled by the measured slowdown of
workers sharing the cores), prediction_error (|predicted - measured| / measured); time_scale, cores and
load_average (os.getloadavg() after the run: a loaded machine makes every measurement slower); dp_engine_step_s, ddp_step_s, dp_ratio_vs_ddp; "cases"
with every case's figures; and "fit_cores": the same for the job resized to this machine's
cores (nodes = cores // gpus_per_node, f lowered if needed) when the job has more ranks than
cores: the prediction with no core sharing at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_hpc.config import load_job  # noqa: E402
from oobleck_hpc.testing.harness import WorkerPool  # noqa: E402
from oobleck_hpc.errors import PlanningError  # noqa: E402
from oobleck_hpc.data import dataset_for  # noqa: E402
from oobleck_hpc.models.base import build_model  # noqa: E402
from oobleck_hpc.planning import cost  # noqa: E402
from oobleck_hpc.planning.plan import PipelineSpec, Plan  # noqa: E402
from oobleck_hpc.planning.templates import make_template  # noqa: E402
from oobleck_hpc.profiling import resolve_profile  # noqa: E402


def steady(results: list[dict | None], warmup: int) -> float:
    rows = [r["times"] for r in results if r is not None and r.get("times")]
    per_step = [max(ts) for ts in zip(*rows)][warmup:]
    return statistics.median(per_step)


def split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def hand_plans(job, profile, nodes: list[str]) -> dict[str, Plan]:
    L, G, M = profile.num_layers, job.cluster.gpus_per_node, job.train.global_microbatches
    out = {}
    dp = make_template(profile, [(0, L, G, 0, 0)], 1, M // len(nodes))
    pipes = [PipelineSpec(dp, (n,), m) for n, m in zip(nodes, split(M, len(nodes)))]
    out["pure_dp"] = Plan(tuple(pipes), M, 0.0)
    if G == 2:
        t1 = make_template(profile, [(0, L // 2, 1, 0, 0), (L // 2, L, 1, 0, 1)], 1,
                           M // len(nodes))
        pipes = [PipelineSpec(t1, (n,), m) for n, m in zip(nodes, split(M, len(nodes)))]
        out["two_stage"] = Plan(tuple(pipes), M, 0.0)
    if G == 2 and len(nodes) >= 4 and L >= 4:
        t1 = make_template(profile, [(0, L // 2, 1, 0, 0), (L // 2, L, 1, 0, 1)], 1, M // 3)
        t2 = make_template(profile, [(0, 2, 2, 0, 0), (2, L - 2, 1, 1, 0), (L - 2, L, 1, 1, 1)],
                           2, M // 3)
        rest = nodes[3:]
        pipes = [PipelineSpec(t1, (nodes[0],), 0), PipelineSpec(t2, (nodes[1], nodes[2]), 0)]
        pipes += [PipelineSpec(t1, (n,), 0) for n in rest]
        # Split the batch so that no pipeline is a straggler (by the cost model).
        counts = [1] * len(pipes)
        for _ in range(M - len(pipes)):
            times = [cost.pipeline_iteration_ms(p.template, c + 1) for p, c in zip(pipes, counts)]
            counts[times.index(min(times))] += 1
        pipes = [PipelineSpec(p.template, p.nodes, c) for p, c in zip(pipes, counts)]
        out["hetero"] = Plan(tuple(pipes), M, 0.0)
    return out


def bench(job, steps: int, warmup: int, rounds: int) -> dict:
    """Every case of one job configuration in one pool (see module docstring)."""
    from oobleck_hpc.planning import plan_job

    job.fault_tolerance.collective_timeout_s = 120.0
    profile = resolve_profile(job)
    model = build_model(job.model)
    data = dataset_for(job.data, model, job.source)  # pickles as its path: workers re-map it
    pool = WorkerPool(job.cluster.nodes, job.cluster.gpus_per_node)
    try:
        nodes = pool.node_names
        # The hand-made plans' templates from the profile the planner uses for this job on this
        # host (times scaled by the cores' sharing; planning/cost.py).
        jprofile = cost.job_profile(job, profile)
        plans = hand_plans(job, jprofile, nodes)
        try:
            plans = {"planner": plan_job(job, profile, nodes)[2], **plans}
        except PlanningError as e:
            print(f"no planner case: {e}", file=sys.stderr)
        best: dict[str, float] = {}

        def measure(key: str, kind: str, plan: Plan | None) -> None:
            res = pool.run(kind, job, plan, steps + warmup, data, timeout_s=150,
                           return_params=False)
            t = steady(res, warmup)
            best[key] = min(best.get(key, t), t)

        for _ in range(rounds):
            measure("reference", "reference", None)
            for name, plan in plans.items():
                measure(name, "engine", plan)
            measure("ddp", "ddp", plans["pure_dp"])
    finally:
        pool.close()
    reference_s, ddp_s = best["reference"], best["ddp"]
    cases = {}
    for name, plan in plans.items():
        measured = best[name]
        predicted = cost.predicted_step_ms(plan, jprofile) / 1000.0
        cases[name] = {
            "engine_step_s": measured, "reference_step_s": reference_s,
            "ratio": measured / reference_s, "predicted_step_s": predicted,
            "prediction_error": abs(predicted - measured) / measured,
            "pipelines": [f"{p.template.num_nodes}n/{p.template.num_stages}st x{p.microbatches}"
                          for p in plan.pipelines],
        }
    top_name = next(k for k in ("planner", "hetero", "two_stage") if k in cases)
    return {**{k: v for k, v in cases[top_name].items() if k != "pipelines"},
            "plan": top_name,
            "dp_engine_step_s": cases["pure_dp"]["engine_step_s"], "ddp_step_s": ddp_s,
            "dp_ratio_vs_ddp": cases["pure_dp"]["engine_step_s"] / ddp_s,
            "nodes": len(nodes), "ranks": len(nodes) * job.cluster.gpus_per_node,
            "f": job.fault_tolerance.f, "cores": cost.host_cores(),
            "time_scale": cost.job_slowdown(job, profile),
            "load_average": list(os.getloadavg()), "cases": cases}


def show(title: str, out: dict) -> None:
    print(f"{title}: {out['nodes']} nodes, {out['ranks']} ranks, f = {out['f']}, times x"
          f"{out['time_scale']:.2f} ({out['ranks']} ranks on {out['cores']} cores), load average "
          f"after the run {' '.join(f'{x:.1f}' for x in out['load_average'])}")
    for name, c in out["cases"].items():
        print(f"  {name:9s} engine {c['engine_step_s'] * 1e3:7.1f} ms  reference "
              f"{c['reference_step_s'] * 1e3:7.1f} ms  ratio {c['ratio']:.2f}  predicted "
              f"{c['predicted_step_s'] * 1e3:7.1f} ms  error {c['prediction_error']:.0%}  "
              f"{' '.join(c['pipelines'])}")
    print(f"  pure_dp vs DDP: {out['dp_engine_step_s'] * 1e3:.1f} ms vs "
          f"{out['ddp_step_s'] * 1e3:.1f} ms = {out['dp_ratio_vs_ddp']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="examples/gpt-tiny-local.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every case this many times, interleaved; keep the fastest "
                         "(a shared machine's load only ever adds time)")
    ap.add_argument("--nodes", type=int, default=4, help="cluster.nodes for the benchmark")
    ap.add_argument("--global-microbatches", type=int, default=16,
                    help="train.global_microbatches for the benchmark (>= 1 per pipeline)")
    ap.add_argument("--no-fit-cores", action="store_true",
                    help="skip the second configuration sized to this machine's cores")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sizes = {"cluster.nodes": args.nodes, "train.global_microbatches": args.global_microbatches,
             "faults": []}
    job = load_job(args.job, sizes)
    out = bench(job, args.steps, args.warmup, args.rounds)
    out.update(model=job.model.name, cores=os.cpu_count(),
               global_batch=job.train.global_microbatches * job.train.microbatch_size)
    g = job.cluster.gpus_per_node
    fit_nodes = max(1, (os.cpu_count() or 1) // g)
    if not args.no_fit_cores and fit_nodes < job.cluster.nodes:
        # The profile was measured one process per core; with more ranks than cores the cost
        # model scales every time by the measured core sharing (cost.job_slowdown). Sized to
        # the cores, the prediction is checked with no scaling at all.
        small = load_job(args.job, {**sizes, "cluster.nodes": fit_nodes,
                                    "fault_tolerance.f": min(job.fault_tolerance.f, fit_nodes - 1)})
        out["fit_cores"] = bench(small, args.steps, args.warmup, args.rounds)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        show("job", out)
        if "fit_cores" in out:
            show("sized to the cores", out["fit_cores"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
