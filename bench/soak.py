"""Soak: the demo job for thousands of steps under a CPU hog with random stragglers, no failure.

    python bench/soak.py --json                    # 2000 steps, 3 stragglers, seed 0
    python bench/soak.py --json --steps 100        # a quick check (~1 min on 2 cores)

One run of the demo job (examples/gpt-tiny-local.yaml: gpt-tiny, 5 local nodes x 2 worker
processes, gloo on CPU, f = 1; its `faults:` replaced) through `oobleck-hpc run --max-requeues
0`, for `--steps` steps, while `nproc` busy-loop processes keep every core busy from the start
(bench/recovery.py's `cpu_hog`). `--stragglers` distinct nodes, drawn with a seeded RNG
(`--seed`), are slowed at a random step each (in the middle 80 % of the run) by a random factor
in [1.5, 3] -- the `slow` fault of the job file (control/faults.py: from then on the node's
agent stops and continues its workers so that their computation takes `factor` times as long);
the straggler handling (recovery/straggler.py; `--straggler`, auto as in the demo) may keep,
rebalance or exclude them; with `--straggler none` they stay in the plan, slow, to the end.
Nothing fails: no node may be lost (a slow or starved node is not a dead one) and no step may
fail, so nothing is replayed (issue 31's acceptance: 2,000 steps, no node evicted, no step
replayed).

Prints (one JSON object with `--json`): `steps_committed` (distinct steps in the metrics file,
of `steps`), `evicted` (nodes lost, from the `recovered` events: lost and not drained; expected
none), `steps_failed` (`step_failed` events) and `steps_replayed` (the distinct steps they
name; both expected 0), `recoveries` (`recovered` events: lost, joined, drained),
`membership_changes` (the agents' new generations that lost or took in a node), `stragglers`
(the slow faults as drawn), `slowed` (the nodes slowed: `node_slowed`), `straggler_decisions`
(the `straggler` events, one per node, step and action) and `straggler_excluded` (the nodes
that an `exclude` decision let leave, as a drain: not counted as evicted), `wall_s` (launch to
exit), the launcher's `code` (-9: still running at `--timeout`, killed) and `ended` (its
`run_ended` reason: e.g. a fallback to the checkpoint). The exit code is 1 when a node was
evicted, a step failed, the job did not commit every step or ended with a non-zero code (its
run directory is then kept, and named on stderr, as with `--keep`); else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import cpu_hog, start, stop  # noqa: E402  (the same launch and hog helpers)

from oobleck_hpc.records import events as ev  # noqa: E402
from oobleck_hpc.records.events import read_events, read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "gpt-tiny-local.yaml"


def stragglers(rng: random.Random, nodes: int, steps: int, count: int) -> list[dict]:
    """`count` slow faults on distinct nodes (a node is slowed once: control/agent.py), each at a
    random step in the middle 80 % of the run, by a random factor in [1.5, 3]."""
    lo, hi = max(2, steps // 10), max(3, steps - steps // 10)
    return [{"node": n, "step": rng.randint(lo, hi), "phase": "forward", "kind": "slow",
             "factor": round(rng.uniform(1.5, 3.0), 2)}
            for n in sorted(rng.sample(range(nodes), min(count, nodes)))]


def job_dict(run_dir: Path, steps: int, faults: list[dict], straggler: str) -> dict:
    """The demo job, run for `steps` steps in `run_dir` with these faults instead of its own and
    this straggler handling (fault_tolerance.straggler)."""
    d = yaml.safe_load(DEMO.read_text())
    d["name"] = "bench-soak"
    d["fault_tolerance"]["straggler"] = straggler
    d["train"].update(steps=steps, log_every=max(10, steps // 20))
    d["profile"]["library"] = str(ROOT / d["profile"]["library"])
    d["run_dir"] = str(run_dir)
    d["faults"] = faults
    return d


def tally(events: list[dict], rows: list[dict]) -> dict:
    """What the run's events and metrics say (module docstring)."""
    recovered = [e for e in events if e["kind"] == ev.RECOVERED]
    failed = [e for e in events if e["kind"] == ev.STEP_FAILED]
    gens = {e["gen"]: e for e in events if e["kind"] == ev.AGREEMENT_REACHED
            and (e["lost"] or e["joined"])}
    decisions = {(e["node"], e["step"], e["action"]): e for e in events
                 if e["kind"] == ev.STRAGGLER}
    return {
        "steps_committed": len({r["step"] for r in rows}),
        "evicted": sorted({n for e in recovered for n in e["lost"] if n not in e["drained"]}),
        "steps_failed": len(failed),
        "steps_replayed": len({e["step"] for e in failed}),
        "recoveries": [{k: e[k] for k in ("step", "lost", "joined", "drained", "seconds")}
                       for e in recovered],
        "membership_changes": [{k: e[k] for k in ("gen", "lost", "joined", "how")}
                               for _, e in sorted(gens.items())],
        "slowed": [{"node": e["node"], "factor": e["factor"]} for e in events
                   if e["kind"] == ev.NODE_SLOWED],
        "straggler_decisions": [{k: e[k] for k in ("node", "step", "action", "slowdown")}
                                for e in decisions.values()],
        "straggler_excluded": sorted({e["node"] for e in decisions.values()
                                      if e["action"] == "exclude"}),
        "ended": next((e["reason"] for e in events if e["kind"] == ev.RUN_ENDED), None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--stragglers", type=int, default=3, help="nodes slowed, each once")
    p.add_argument("--seed", type=int, default=0, help="of the stragglers' nodes, steps, factors")
    p.add_argument("--straggler", default="auto", choices=("auto", "none", "rebalance", "exclude"),
                   help="fault_tolerance.straggler (none: the slowed nodes stay in the plan)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds the run may take (default: 300 + 1 s per step)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    if a.steps < 20:
        p.error("--steps must be >= 20 (the stragglers need room to be found)")
    nodes = yaml.safe_load(DEMO.read_text())["cluster"]["nodes"]
    faults = stragglers(random.Random(a.seed), nodes, a.steps, a.stragglers)
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    run_dir = work / "run"
    run_dir.mkdir()
    job = work / "soak.yaml"
    job.write_text(yaml.safe_dump(job_dict(run_dir, a.steps, faults, a.straggler)))
    hog = cpu_hog(os.cpu_count() or 2)  # from the start: the whole run competes for every core
    t0 = time.time()
    try:
        proc = start(job, run_dir, run_dir / "metrics.jsonl", work / "soak.log")
        try:
            proc.wait(timeout=a.timeout or 300 + a.steps)
        except subprocess.TimeoutExpired:  # (told as the launcher's code: -9, killed by stop)
            pass
        finally:
            stop(proc, run_dir)
        wall = time.time() - t0
        out = {**tally(read_events(run_dir / "events.jsonl"),
                       read_jsonl(run_dir / "metrics.jsonl")),
               "steps": a.steps, "code": proc.returncode, "wall_s": round(wall, 1),
               "stragglers": faults, "seed": a.seed, "straggler": a.straggler, "nodes": nodes,
               "workers_per_node": 2,
               "job": str(DEMO.relative_to(ROOT)), "host": platform.node(),
               "cpus": os.cpu_count()}
        out["ok"] = (not out["evicted"] and out["steps_failed"] == 0 and out["code"] == 0
                     and out["steps_committed"] == a.steps)
    finally:
        for h in hog:
            h.kill()
            h.wait()
    if a.keep or not out["ok"]:  # (a failed soak's run is kept to be read: `oobleck-hpc report`)
        print(f"run kept in {run_dir} (log: {work / 'soak.log'})", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['steps_committed']}/{a.steps} steps in {out['wall_s']} s under a CPU hog, "
              f"{len(out['slowed'])} nodes slowed: evicted {out['evicted'] or 'none'}, "
              f"{out['steps_failed']} steps failed, straggler decisions "
              f"{[(d['node'], d['action']) for d in out['straggler_decisions']]}"
              + ("" if out["ok"] else "  NOT OK"))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
