"""Straggler mitigation: one node slowed 2x, kept as it is, re-planned around, or excluded.

    python bench/straggler.py --json [--steps 80] [--factor 2] [--nodes 4]

Four runs of the same local job (gpt-tiny, `--nodes` nodes x 1 worker, gloo on CPU, the
analytic A40 profile: two 2-node pipelines on 4 nodes), each through `oobleck-hpc run`:

- baseline: no fault;
- slowed: node1's worker slowed `--factor` times from step `--slow-at` on (the `slow` fault: its
  agent stops and continues it on a duty cycle), straggler handling off (`straggler: none`);
- mitigated: the same, `straggler: auto` (recovery/straggler.py: detect, then the action the
  planner predicts fastest among keep, rebalance the batch, exclude the node);
- excluded: the same, `straggler: exclude`.

Step times are medians over the steps after the action (or, without one, after the detection
window would have ended): `baseline_step_s`, `slowed_step_s`, `mitigated_step_s`,
`excluded_step_s`. `action`: what auto chose; `detect_steps`: committed steps from the slowdown
to the decision (the rule, recovery/straggler.py: the median over the last `straggler_steps` = 5
steps, and at least `straggler_window_s` = 1 s of them (WINDOW_S; default 10 s), of the node's
compute relative to its own baseline and to the median node is >= `straggler_ratio` = 1.5: a
window's majority of slowed steps). Target: mitigated_step_s within 10 % of the better of keeping
(slowed_step_s) and excluding (excluded_step_s): `within_10pct`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from oobleck_hpc.records import events as ev
from oobleck_hpc.records.events import read_events, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 1.0
"""fault_tolerance.straggler_window_s here (default 10 s): ~10 of these ~0.1 s steps."""


def job_dict(run_dir: Path, nodes: int, steps: int, straggler: str, fault: dict | None) -> dict:
    return {
        "name": "bench-straggler",
        "model": {"name": "gpt-tiny", "seed": 0},
        "train": {"steps": steps, "microbatch_size": 2, "global_microbatches": 16, "lr": 1e-3,
                  "warmup_steps": 2, "log_every": 10},
        "cluster": {"launch": "local", "nodes": nodes, "gpus_per_node": 1, "device": "cpu"},
        "fault_tolerance": {"f": 1, "collective_timeout_s": 20.0, "straggler": straggler,
                            "straggler_window_s": WINDOW_S},
        "profile": {"library": str(run_dir / "no-profiles"), "analytic": True, "device": "A40"},
        "run_dir": str(run_dir),
        "faults": [fault] if fault else [],
    }


def run(work: Path, name: str, nodes: int, steps: int, straggler: str, fault: dict | None,
        after: int) -> dict:
    """One run; the median step time from step `after` on (or after the straggler action)."""
    run_dir = work / name
    run_dir.mkdir(parents=True)
    job = work / f"{name}.yaml"
    job.write_text(yaml.safe_dump(job_dict(run_dir, nodes, steps, straggler, fault)))
    out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "run", str(job),
                          "--max-requeues", "0"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{name}: exit {out.returncode}\n{out.stdout[-3000:]}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    events = read_events(run_dir / "events.jsonl")
    acted = [e for e in events if e["kind"] == ev.STRAGGLER and e["action"] != "keep"
             and e["source"] == "node0/0"]  # (the slow node tells it too)
    measured = [e for e in events if e["kind"] == ev.STRAGGLER_MEASURED]
    if acted:  # from the first step on the new plan (excluded: after the recovery)
        start = acted[0]["step"] + (2 if acted[0]["action"] == "exclude" else 1)
    else:
        start = after
    times = [r["seconds"] for r in rows if r["step"] > start]
    return {"step_s": round(statistics.median(times), 4), "steps_measured": len(times),
            "straggler": [{k: e[k] for k in ("step", "node", "slowdown", "action",
                                              "predicted_ms")} for e in acted],
            "measured": [{k: e[k] for k in ("action", "before_s", "after_s")} for e in measured]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--slow-at", type=int, default=10, help="step the slowdown starts in "
                    "(after the plan's first step and the nodes' baselines: steps 2-6)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    slow = {"node": 1, "step": a.slow_at, "phase": "forward", "kind": "slow", "factor": a.factor}
    settle = a.slow_at + 5 + 3  # the detection window and a little
    work = Path(tempfile.mkdtemp(prefix="bench-straggler-"))
    try:
        base = run(work, "baseline", a.nodes, a.steps, "none", None, settle)
        slowed = run(work, "slowed", a.nodes, a.steps, "none", slow, settle)
        auto = run(work, "mitigated", a.nodes, a.steps, "auto", slow, settle)
        excl = run(work, "excluded", a.nodes, a.steps, "exclude", slow, settle)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    chosen = auto["straggler"][0] if auto["straggler"] else None
    best = min(slowed["step_s"], excl["step_s"])
    out = {"baseline_step_s": base["step_s"], "slowed_step_s": slowed["step_s"],
           "mitigated_step_s": auto["step_s"], "excluded_step_s": excl["step_s"],
           "action": chosen["action"] if chosen else "keep",
           "detect_steps": chosen["step"] - a.slow_at + 1 if chosen else None,
           "slowdown_measured": chosen["slowdown"] if chosen else None,
           "predicted_ms": chosen["predicted_ms"] if chosen else None,
           "within_10pct": auto["step_s"] <= 1.1 * best,
           "factor": a.factor, "nodes": a.nodes, "steps": a.steps, "slow_at": a.slow_at,
           "runs": {"baseline": base, "slowed": slowed, "mitigated": auto, "excluded": excl},
           "host": platform.node(), "cpus": os.cpu_count()}
    print(json.dumps(out, indent=1) if a.json else
          "\n".join(f"{k}: {v}" for k, v in out.items() if k != "runs"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
