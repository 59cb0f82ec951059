"""What authenticating the control plane costs (issue 28): step time and recovery time with the
MACs on vs off, on the same job, alternating within one run.

    python bench/auth.py --json              # 4 nodes x 2 workers, gpt-tiny, 3 reps
    python bench/auth.py --json --reps 5 --steps 80

On: the product as it ships (control/auth.py: every frame sealed with HMAC-SHA256, every HELLO
checked). Off: the same code with the MAC computation replaced by a constant (a sitecustomize
on the PYTHONPATH of the off runs only: key derivation and sealing cost nothing; the HELLO's
fields, the 32 bytes per frame and the replay cache stay -- a few dozen bytes per message and
one dict lookup per connection), so the difference is what the cryptography costs on the
hot paths: the commit vote of every step, and a recovery's rounds and fresh connections.

- step_s: the median step time (metrics `seconds`) of a failure-free run of `--steps` steps,
  steps 6 on (the first ones allocate);
- recovery_s: a kill of node1 after 4 committed steps -> first step committed again
  (bench/recovery.py's `oobleck_once`, checkpointing every 3 steps).

Targets: step time +2 % at most, recovery time +10 % at most (medians over --reps; on this
noisy 2-core machine a single rep varies by more than that: compare medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import job_dict, oobleck_once, start, stop, wait_steps  # noqa: E402

SHIM = '''
import oobleck_hpc.control.auth as auth

def _mac(self, body):
    self.seq += 1
    return bytes(auth.MAC_BYTES)

auth.Sealer._mac = _mac
auth.keys = lambda secret, nonce, src, to: (b"c", b"a")
'''
"""sitecustomize.py of the 'off' runs (module docstring)."""


def steady_step_s(work: Path, nodes: int, steps: int) -> float:
    run_dir = work / "run"
    run_dir.mkdir(parents=True)
    d = job_dict(run_dir, nodes, steps, None)
    d["train"]["log_every"] = 1
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    metrics = run_dir / "metrics.jsonl"
    proc = start(job, run_dir, metrics, work / "run.log")
    try:
        rows = wait_steps(metrics, steps, proc, 600)
        proc.wait(timeout=120)
    finally:
        stop(proc, run_dir)
    return statistics.median(r["seconds"] for r in rows[5:])


def measure(work: Path, nodes: int, steps: int, auth: bool) -> dict:
    env = dict(os.environ)
    if not auth:
        shim = work / "shim"
        shim.mkdir(parents=True)
        (shim / "sitecustomize.py").write_text(SHIM)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(shim), *[p for p in [env.get("PYTHONPATH")] if p]])
    try:
        step = steady_step_s(work / "steps", nodes, steps)
        rec = oobleck_once(work, nodes, 4, 30, "kill")
    finally:
        os.environ.clear()
        os.environ.update(env)
    if rec["code"] != 0:
        raise RuntimeError(f"the kill run exited {rec['code']} ({work})")
    return {"step_s": step, "recovery_s": rec["recovery_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        for i in range(a.reps):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")  # (drift hits both alike)
            for mode in order:
                runs[mode].append(measure(work / f"rep{i}-{mode}", a.nodes, a.steps, mode == "on"))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("step_s", "recovery_s")}
           for m in runs}
    step_pct = 100 * (med["on"]["step_s"] / med["off"]["step_s"] - 1)
    rec_pct = 100 * (med["on"]["recovery_s"] / med["off"]["recovery_s"] - 1)
    out = {"nodes": a.nodes, "reps": a.reps, "steps": a.steps, "runs": runs,
           "step_s": {m: round(v["step_s"], 5) for m, v in med.items()},
           "recovery_s": {m: round(v["recovery_s"], 4) for m, v in med.items()},
           "step_overhead_pct": round(step_pct, 2), "recovery_overhead_pct": round(rec_pct, 2),
           "meets_targets": step_pct <= 2 and rec_pct <= 10,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    print(json.dumps(out, indent=1) if a.json else
          f"step {med['off']['step_s']:.4f} -> {med['on']['step_s']:.4f} s ({step_pct:+.1f} %), "
          f"recovery {med['off']['recovery_s']:.3f} -> {med['on']['recovery_s']:.3f} s "
          f"({rec_pct:+.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
