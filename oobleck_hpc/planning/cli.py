"""`oobleck-hpc plan JOB.yaml [--nodes N] [--json]`: what the planner would run, and what it
would do after failures.

Prints the templates (nodes, stages, predicted 1F1B time, peak memory per GPU), the plan
(pipelines, microbatches each, predicted step time as the engine executes it, samples/s) and a
survivability table: for k = 0..f lost nodes, the slowest plan reconfiguration reaches over
EVERY loss set of k nodes (slowest in the planner's objective, planning/cost.py; shown as its
predicted step time, the one number the console and the plan use), its throughput relative to
k = 0, and among the loss sets that reach it the one that moves the most bytes. With
`cluster.spares: s`, each row also gives the throughput once min(k, s) spares are swapped in by
the same recovery (`with spares`: what the spares buy; a spare restores nodes, not layers that
lost every replica, so it never turns a row beyond the guarantee into a survivable one). The
new plan's time depends only on the survivors' count, and which plan is valid only on how many
nodes each pipeline loses, so one loss set per pattern of per-pipeline loss counts is
tried (reconfigure.loss_patterns; `patterns` says how many; the bytes moved are those of that
loss set, which loses each pipeline's first nodes). With --json: one object with keys
templates, plan, survivability, planning_seconds (templates and plan), survivability_seconds
and seconds (the three phases: loading the job and its profile, planning, the table). --wide
prints every template's layout whole.

The profile comes from `oobleck_hpc.profiling.resolve_profile(job)` (explicit path, library,
or analytic when the job sets profile.analytic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from oobleck_hpc.records.story import plural


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the pipeline templates, the plan and its survivability")
    p.add_argument("job", help="YAML job file")
    p.add_argument("--nodes", type=int, default=None, help="plan for this many nodes (default: cluster.nodes)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--wide", action="store_true",
                   help=f"print every template's layout whole (cut at {LAYOUT_WIDTH} characters "
                        f"otherwise)")
    p.set_defaults(func=run)


LAYOUT_WIDTH = 70


def _layout(template) -> str:
    """Stages as runs: '3x[2L/1g]' = three consecutive stages of 2 layers on 1 GPU."""
    runs: list[list] = []
    for s in template.stages:
        key = (s.layer_end - s.layer_start, len(s.gpus))
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    return " ".join(f"{n}x[{l}L/{g}g]" if n > 1 else f"[{l}L/{g}g]" for (l, g), n in runs)


def survivability(plan, templates, profile, f: int, microbatch_size: int,
                   spares: int = 0) -> list[dict]:
    from oobleck_hpc.errors import GuaranteeExceeded
    from oobleck_hpc.planning.cost import predicted_step_ms, samples_per_second
    from oobleck_hpc.planning.reconfigure import loss_patterns, reconfigure, reconfigure_moved

    base = predicted_step_ms(plan, profile)
    rows: list[dict[str, Any]] = []
    for k in range(0, f + 1):
        patterns = loss_patterns(plan, k)
        worst: dict[str, Any] | None = None
        for name, lost in patterns:
            try:
                new, moved = ((plan, 0) if k == 0
                              else reconfigure_moved(plan, lost, templates, profile, f))
            except GuaranteeExceeded as e:
                worst = {"lost": k, "pattern": name, "patterns": len(patterns), "error": str(e)}
                break
            if worst is None or (new.predicted_iteration_ms, moved) > (worst["objective_ms"],
                                                                        worst["moved_bytes"]):
                step_ms = predicted_step_ms(new, profile)
                worst = {"lost": k, "pattern": name, "patterns": len(patterns),
                         "objective_ms": new.predicted_iteration_ms,
                         "step_ms": step_ms,
                         "samples_per_s": samples_per_second(new, microbatch_size, step_ms),
                         "relative_throughput": base / step_ms,
                         "pipelines": [p.template.num_nodes for p in new.pipelines],
                         "moved_bytes": moved}
                if spares:  # the same losses, with the spares swapped in by their round
                    swapped = reconfigure(plan, lost, templates, profile, f, joined=[
                        f"spare{i}" for i in range(min(k, spares))]) if lost else new
                    spare_ms = predicted_step_ms(swapped, profile)
                    worst["with_spares"] = {
                        "spares_in": min(k, spares), "step_ms": spare_ms,
                        "samples_per_s": samples_per_second(swapped, microbatch_size, spare_ms),
                        "relative_throughput": base / spare_ms}
        assert worst is not None, f"no loss pattern of {k} nodes"  # loss_patterns gives >= 1
        rows.append(worst)
    return rows


def plan_report(job, profile, num_nodes: int) -> dict:
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.planning.cost import (job_profile, job_slowdown, pipeline_iteration_ms,
                                          predicted_step_ms, samples_per_second, sharing_note)

    t0 = time.perf_counter()
    nodes = tuple(f"node{i}" for i in range(num_nodes))
    spec, templates, plan = plan_job(job, profile, nodes)
    seconds = time.perf_counter() - t0
    mbs = job.train.microbatch_size
    scaled = job_profile(job, profile)  # what the templates were built from (plan_job)
    step_ms = predicted_step_ms(plan, scaled)
    tmpl = [{"nodes": n, "stages": t.num_stages, "layout": _layout(t),
             "stage_layers": [[s.layer_start, s.layer_end] for s in t.stages],
             "stage_gpus": [len(s.gpus) for s in t.stages],
             "microbatches": t.microbatches,
             "iteration_ms": pipeline_iteration_ms(t, t.microbatches),
             "peak_memory_bytes": max(t.peak_memory_bytes)}
            for n, t in sorted(templates.items())]
    plan_d = {"nodes": len(plan.nodes), "gpus_per_node": plan.gpus_per_node,
              "n0": spec.n0, "f": spec.f, "global_microbatches": plan.global_microbatches,
              "objective_ms": plan.predicted_iteration_ms,
              "step_ms": step_ms,
              "samples_per_s": samples_per_second(plan, mbs, step_ms),
              "digest": plan.digest(),
              "pipelines": [{"template_nodes": p.template.num_nodes, "microbatches": p.microbatches,
                             "nodes": [p.nodes[0], p.nodes[-1]]} for p in plan.pipelines]}
    # Reconfigure with the profile the templates were built from (core-scaled on a CPU host).
    t1 = time.perf_counter()
    surv = survivability(plan, templates, scaled, job.fault_tolerance.f, mbs,
                         spares=job.cluster.spares)
    surv_seconds = time.perf_counter() - t1
    return {"job": job.name, "model": job.model.name,
            "profile": {"source": profile.fingerprint.source, "device": profile.machine.device_name,
                        "layers": profile.num_layers,
                        "time_scale": job_slowdown(job, profile),
                        "note": sharing_note(job, profile)},
            "templates": tmpl, "plan": plan_d, "survivability": surv,
            "spares": job.cluster.spares,
            "planning_seconds": seconds,
            "survivability_seconds": surv_seconds}


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 or n == 0 else f"{n / 1e6:.2f} MB"


def _print(rep: dict, wide: bool = False) -> None:
    p = rep["plan"]
    print(f"job {rep['job']}: model {rep['model']} ({rep['profile']['layers']} layers, "
          f"{rep['profile']['source']} profile, {rep['profile']['device']}), {p['nodes']} nodes x "
          f"{p['gpus_per_node']} GPUs, n0 = {p['n0']}, f = {p['f']}"
          + (f", {plural(rep['spares'], 'spare')}" if rep["spares"] else ""))
    if rep["profile"]["note"]:
        print(f"note: {rep['profile']['note']} (an upper bound: with few microbatches per "
              f"pipeline most workers wait, and steps run faster)")
    print(f"\n{plural(len(rep['templates']), 'template')} (1F1B time for m microbatches):")
    print(f"{'nodes':>5} {'stages':>6} {'m':>4} {'time ms':>10} {'peak/GPU':>10}  layout [layers/GPUs]")
    cut = False
    for t in rep["templates"]:
        lay = t["layout"]
        if not wide and len(lay) > LAYOUT_WIDTH:
            lay, cut = lay[:LAYOUT_WIDTH - 3] + "...", True
        print(f"{t['nodes']:>5} {t['stages']:>6} {t['microbatches']:>4} {t['iteration_ms']:>10.2f} "
              f"{_gb(t['peak_memory_bytes']):>10}  {lay}")
    if cut:
        print(f"(layouts longer than {LAYOUT_WIDTH} characters end in '...': --wide prints them "
              f"whole, --json gives every stage)")
    groups: dict[tuple[int, int], int] = {}
    for x in p["pipelines"]:
        key = (x["template_nodes"], x["microbatches"])
        groups[key] = groups.get(key, 0) + 1
    print(f"\nplan {p['digest']}: {plural(len(p['pipelines']), 'pipeline')}, "
          f"{plural(p['global_microbatches'], 'microbatch', 'microbatches')}, predicted step "
          f"{p['step_ms']:.2f} ms, {p['samples_per_s']:.2f} samples/s")
    for (n, m), c in sorted(groups.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        print(f"  {c:>4} x pipeline of {plural(n, 'node'):>9}, "
              f"{plural(m, 'microbatch', 'microbatches')} each")
    print("\nsurvivability (worst case over every loss set of each size):")
    spares = rep["spares"]
    print(f"{'lost':>4} {'step ms':>10} {'samples/s':>10} {'relative':>9} {'moved':>10}  "
          + (f"{'with spares':>22}  " if spares else "") + "worst pattern (of how many)")
    for r in rep["survivability"]:
        if "error" in r:
            print(f"{r['lost']:>4} {'beyond guarantee':>42}  {r['pattern']} (of {r['patterns']}): "
                  f"{r['error']}")
            continue
        w = r.get("with_spares")
        swapped = (f"{w['spares_in']} in: {w['samples_per_s']:>8.2f} ({w['relative_throughput']:.3f})"
                   if w else "")
        print(f"{r['lost']:>4} {r['step_ms']:>10.2f} {r['samples_per_s']:>10.2f} "
              f"{r['relative_throughput']:>9.3f} {_gb(r['moved_bytes']):>10}  "
              + (f"{swapped:>22}  " if spares else "") + f"{r['pattern']} (of {r['patterns']})")
    if spares:
        print(f"with {plural(spares, 'spare')}: up to {plural(spares, 'loss', 'losses')} over "
              f"the run {'is' if spares == 1 else 'are'} replaced, each at the step after it (the "
              f"job keeps its "
              f"{plural(rep['plan']['nodes'], 'node')}); losses spread over the run are survived "
              f"while spares last, at most f = {rep['plan']['f']} at once")
    print("relative: samples/s over the no-loss plan's (same global batch). Each row's plan is "
          "the one the\n  planner's objective picks (planning/cost.py); step ms evaluates it as "
          "the engine runs it, so a\n  plan on fewer nodes can be predicted slightly faster than "
          "the first plan (relative > 1), and\n  rows need not decrease.\n"
          "moved: layer state (parameters and AdamW moments) copied to every GPU that lacks it, "
          "one copy\n  per GPU of a multi-GPU stage (copies inside a node included).")
    t = rep["seconds"]
    print(f"\ntook {sum(t.values()):.2f} s: job and profile {t['profile']:.2f} s, templates and "
          f"plan {t['planning']:.2f} s, survivability table {t['survivability']:.2f} s")


def run(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.errors import ConfigError

    overrides = {}
    if args.nodes is not None:
        if args.nodes < 1:
            raise ConfigError("--nodes", "--nodes", f"value {args.nodes} must be at least 1",
                              "pass a positive node count")
        overrides["cluster.nodes"] = args.nodes
    t0 = time.perf_counter()
    job = load_job(args.job, overrides)
    from oobleck_hpc.profiling import resolve_profile

    profile = resolve_profile(job)
    loading = time.perf_counter() - t0
    rep = plan_report(job, profile, job.cluster.nodes)
    rep["seconds"] = {"profile": loading, "planning": rep["planning_seconds"],
                      "survivability": rep["survivability_seconds"]}
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(rep, wide=args.wide)
    return 0
