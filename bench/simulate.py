"""Simulator speed and results at scale: a week of simulated time must take <= 10 s.

    python bench/simulate.py            # a table
    python bench/simulate.py --json     # machine-readable (what CI compares)

Cases: the paper preset; GPT-3 6.7B and 175B on 1,024 GPUs at one failure per hour; GPT-3 175B
on 16,384 GPUs at Llama 3's public rate (419 unexpected interruptions in 54 days on 16k GPUs:
one per 3.09 h for the cluster); failed nodes are replaced after 1-2 h so a week does not drain
the cluster. `setup_s` is planning (templates, the initial plan), `simulate_s` the replay of the
trace by all three policies (planner calls for node counts not seen before included); `*_cpu_s`
the same in process CPU time, which other load on a shared machine does not inflate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_hpc.sim import run_policies  # noqa: E402
from oobleck_hpc.sim.trace import exponential, fixed_interval, node_names  # noqa: E402

LLAMA3_MTBF_H = 54 * 24 / 419
WEEK_H = 168.0


def paper_case() -> dict:
    from oobleck_hpc.sim.scenario import load_scenario, scenario_backends

    t0, c0 = time.perf_counter(), time.process_time()
    s = load_scenario(ROOT / "examples" / "bert-large-paper.yaml")
    backends = scenario_backends(s)
    duration = s.duration_hours * 3600
    trace = fixed_interval(node_names(s.nodes), 60 * s.every_minutes, duration)
    t1, c1 = time.perf_counter(), time.process_time()
    res = run_policies(backends, trace, duration)
    t2, c2 = time.perf_counter(), time.process_time()
    return _summary("paper preset (BERT-large, 30 nodes, 1 failure / 10 min, 2.5 h)", res,
                    trace.failures, t1 - t0, t2 - t1, c1 - c0, c2 - c1)


def job_case(label: str, path: str, every_min: float | None, mtbf_h: float | None,
             hours: float, replace_min: float, seed: int = 0) -> dict:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.sim.planner_backend import CostParams, planner_backends

    t0, c0 = time.perf_counter(), time.process_time()
    job = load_job(ROOT / path)
    duration = hours * 3600
    nodes = node_names(job.cluster.nodes)
    replace = 60 * replace_min
    trace = (fixed_interval(nodes, 60 * every_min, duration, seed, replace) if every_min
             else exponential(nodes, 3600 * mtbf_h, duration, seed, "cluster", replace))
    backends = planner_backends(job, resolve_profile(job), CostParams(),
                                trace.mean_failure_interval_s(duration))
    t1, c1 = time.perf_counter(), time.process_time()
    res = run_policies(backends, trace, duration)
    t2, c2 = time.perf_counter(), time.process_time()
    return _summary(label, res, trace.failures, t1 - t0, t2 - t1, c1 - c0, c2 - c1)


def _summary(label, res, failures, setup_s, simulate_s, setup_cpu_s=None, simulate_cpu_s=None
             ) -> dict:
    return {"case": label, "failures": failures, "setup_s": round(setup_s, 3),
            "simulate_s": round(simulate_s, 3),
            "setup_cpu_s": None if setup_cpu_s is None else round(setup_cpu_s, 3),
            "simulate_cpu_s": None if simulate_cpu_s is None else round(simulate_cpu_s, 3),
            "policies": {k: {"effective": round(v.shares["effective"], 4),
                             "samples_per_s": round(v.samples_per_s, 3),
                             "shares": {c: round(x, 4) for c, x in v.shares.items() if x}}
                         for k, v in res.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="substring of the case names to run")
    args = ap.parse_args()
    cases = [
        ("paper", paper_case),
        ("6.7b-1k", lambda: job_case("GPT-3 6.7B, 1,024 GPUs, 1 failure / h (replaced after "
                                     "1 h), 1 week", "examples/gpt3-6.7b-1024gpu.yaml", 60, None,
                                     WEEK_H, 60)),
        ("175b-1k", lambda: job_case("GPT-3 175B, 1,024 GPUs, 1 failure / h (replaced after "
                                     "1 h), 1 week", "examples/gpt3-175b-1024gpu.yaml", 60, None,
                                     WEEK_H, 60)),
        ("175b-16k", lambda: job_case(f"GPT-3 175B, 16,384 GPUs, MTBF {LLAMA3_MTBF_H:.2f} h "
                                      "(Llama 3; replaced after 2 h), 1 week",
                                      "examples/gpt3-175b-16kgpu.yaml", None, LLAMA3_MTBF_H,
                                      WEEK_H, 120)),
    ]
    out = [fn() for key, fn in cases if not args.only or args.only in key]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for c in out:
        print(f"{c['case']}: {c['failures']} failures, setup {c['setup_s']} s "
              f"(cpu {c['setup_cpu_s']}), simulate {c['simulate_s']} s (cpu {c['simulate_cpu_s']})")
        for name, p in c["policies"].items():
            shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in p["shares"].items())
            print(f"  {name:9s} {p['samples_per_s']:10.3f} samples/s  {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
