"""Calibrate the analytic A40 model: the matmul efficiency at which the planner predicts the
Oobleck artifact's measured GPT-3 6.7B throughput (profiling/analytic.py, OOBLECK_GPT3_6_7B_A40).

    python bench/calibrate.py [--json]

The job is examples/gpt3-6.7b-paper.yaml (checked against the measurement: model, device, GPUs
per node, microbatch, global batch). Bisects the efficiency in (0, 1] (to 1e-6) until the
planner's predicted samples/s on the fit node count (30) meets the measured one, then prints
every node count's prediction with that efficiency rounded to 3 significant digits (what
DEVICES['A40'] keeps) against the measurement.

Keys of --json: efficiency (the bisected value), kept (rounded), device_efficiency (the one
DEVICES holds now), rows: [{nodes, measured, predicted, error}] at the kept value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oobleck_hpc.config import load_job
from oobleck_hpc.planning.cli import plan_report
from oobleck_hpc.profiling.analytic import DEVICES, OOBLECK_GPT3_6_7B_A40, analytic_profile

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt3-6.7b-paper.yaml"


def predicted(job, nodes: int, efficiency: float) -> float:
    m = OOBLECK_GPT3_6_7B_A40
    profile = analytic_profile(m.model, m.device, m.microbatch_size, job.model.profile_dtype,
                               m.gpus_per_node, matmul_efficiency=efficiency)
    return plan_report(job, profile, nodes)["plan"]["samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = OOBLECK_GPT3_6_7B_A40
    job = load_job(str(EXAMPLE))
    got = (job.model.name, job.profile.device, job.cluster.gpus_per_node,
           job.train.microbatch_size, job.train.global_microbatches)
    want = (m.model, m.device, m.gpus_per_node, m.microbatch_size, m.global_microbatches)
    if got != want:
        raise SystemExit(f"{EXAMPLE}: (model, device, gpus_per_node, microbatch_size, "
                         f"global_microbatches) = {got}, the measurement is of {want}")
    target = m.samples_per_s[m.fit_nodes]
    lo, hi = 1e-3, 1.0
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if predicted(job, m.fit_nodes, mid) < target:
            lo = mid
        else:
            hi = mid
    eff = (lo + hi) / 2
    kept = float(f"{eff:.3g}")
    rows = []
    for n, meas in sorted(m.samples_per_s.items(), reverse=True):
        p = predicted(job, n, kept)
        rows.append({"nodes": n, "measured": meas, "predicted": p, "error": p / meas - 1})
    out = {"efficiency": eff, "kept": kept,
           "device_efficiency": DEVICES[m.device].matmul_efficiency, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{m.source}\nfit on {m.fit_nodes} nodes: efficiency {eff:.4f}, kept {kept} "
          f"(DEVICES[{m.device!r}] holds {out['device_efficiency']})")
    print(f"{'nodes':>5} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['measured']:>9.2f} {r['predicted']:>9.2f} {r['error']:>+7.1%}")


if __name__ == "__main__":
    main()
