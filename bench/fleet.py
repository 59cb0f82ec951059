"""Fleet decision benchmark: the time of one decision (oobleck_hpc/fleet/allocate.py) for 4, 8,
16, 32 and 64 jobs on 4,096 nodes (issue 32: 64 x 4,096 in <= 1 s; the cost per job flat as
jobs are added).

    python bench/fleet.py [--nodes N] [--repeats R]

Prints one JSON object. Three kinds of random curves (seeded), each job with a random weight
in [1, 4] (but `tied`), a current allocation (an even share) and the move cost of a 60 s pause
over a 3 h MTBF:

- `planner`: what a planner's curve looks like -- flat between the node counts where one more
  pipeline fits (a pipeline of 1-16 nodes), rising with diminishing returns, with noise;
- `increasing`: every count better than the last (a strictly increasing random walk): no
  count is dropped as a candidate, only the bound skips work;
- `tied`: the same with equal weights and near-equal slopes, so every split of the nodes is
  nearly as good as the best: the bound skips almost nothing and each job costs a full max-plus
  convolution (N^2 / 2 additions) -- the worst case.

`seconds` is the best of --repeats runs (wall clock), `cpu_seconds` the best of their CPU time
(what a loaded, shared machine does not inflate); `per_job_ms` = seconds / jobs.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from oobleck_hpc.fleet.allocate import JobCurve, candidates, decide, values


def planner_like(rng: np.random.Generator, nodes: int) -> np.ndarray:
    pipeline = int(rng.integers(1, 17))
    n = np.arange(nodes + 1)
    pipelines = n // pipeline
    rate = rng.uniform(0.5, 2.0) * pipelines ** rng.uniform(0.7, 1.0)
    return rate * (1 + 0.05 * rng.standard_normal(nodes + 1)).clip(0.5)


def increasing(rng: np.random.Generator, nodes: int) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(rng.random(nodes) + 0.01)))


def tied(rng: np.random.Generator, nodes: int) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(1 + 1e-3 * rng.random(nodes))))


def jobs_of(kind: str, count: int, nodes: int, seed: int = 0) -> list[JobCurve]:
    rng = np.random.default_rng(seed)
    make = {"planner": planner_like, "increasing": increasing, "tied": tied}[kind]
    return [JobCurve(f"j{i}", make(rng, nodes) * (1.0 if kind == "tied" else rng.uniform(1, 4)),
                     transition_s=60.0, current=nodes // count) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    horizon = 3 * 3600.0
    out: dict = {"nodes": args.nodes, "horizon_s": horizon, "cases": []}
    for kind in ("planner", "increasing", "tied"):
        for count in (4, 8, 16, 32, 64):
            jobs = jobs_of(kind, count, args.nodes)
            best = cpu = float("inf")
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                d = decide(jobs, args.nodes, horizon_s=horizon)
                best = min(best, time.perf_counter() - t0)
                cpu = min(cpu, time.process_time() - c0)
            kept = sum(len(candidates(values(j, args.nodes, horizon))) for j in jobs)
            out["cases"].append({"curves": kind, "jobs": count, "seconds": best,
                                 "cpu_seconds": cpu, "per_job_ms": 1000 * best / count, "candidates": kept,
                                 "nodes_used": sum(d.nodes), "total_waf": d.total_waf})
    out["target_64x4096_s"] = 1.0
    out["seconds_64_jobs"] = {c["curves"]: c["seconds"] for c in out["cases"] if c["jobs"] == 64}
    out["cpu_seconds_64_jobs"] = {c["curves"]: c["cpu_seconds"] for c in out["cases"]
                                  if c["jobs"] == 64}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
