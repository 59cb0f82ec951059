"""Growth: a job that lost a node grows back by `oobleck-hpc grow`, and a spare is swapped in.

    python bench/grow.py --json              # 4 nodes x 2 workers, gpt-tiny (the recovery bench's job)

Two runs of the same job as bench/recovery.py (gpt-tiny, `--nodes` local nodes x 2 worker
processes, gloo on CPU, checkpoints every 3 steps), with as many steps as it takes (stopped once
measured):

- grow: after `--window` committed steps node1 is killed (SIGKILL of its agent and workers,
  `oobleck-hpc kill-node`); the survivors recover in place on one node fewer. `--window` steps
  later `oobleck-hpc grow RUN_DIR --nodes 1` starts a new node, which asks to join once its
  workers are up; a round adds it (no node lost), it receives its layers from the members and
  the job goes on at full size. `join_s` = the new agent's start (its `agent_started` event) ->
  the first step committed on the grown plan (the `recovered` event of its generation);
  `join_round_s`: of that, the agreement that adds it -> that step (what the members wait);
  `grow_request_s`: the `oobleck-hpc grow` command -> that step.
- swap: the same job with `cluster.spares: 1`; after `--window` steps node1 is killed and the
  loss's own round swaps the spare in. `swap_s` = kill -> first step committed with the spare in.

Throughputs are samples/s, the median over `--window` steps (default 60): `throughput_before`
(full size, before the kill), `throughput_shrunk` (one node fewer), `throughput_after` (grown
back). Target (issue 13): `restored_ratio` = throughput_after / throughput_before >= 0.95. On the
shared 2-core machine it varied between runs on the same plan shape (0.82, 0.71 and 1.00 with
windows of 20, 40 and 60 steps; the cause of the low ones is not found): run it several times,
and compare figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import job_dict, start, stop, wait_steps  # noqa: E402  (the same job and helpers)

from oobleck_hpc.elastic.events import read_events, read_jsonl  # noqa: E402


def throughput(rows: list[dict]) -> float:
    return round(statistics.median(r["samples"] / r["seconds"] for r in rows), 2)


def wait_event(run_dir: Path, match, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in read_events(run_dir / "events.jsonl"):
            if match(e):
                return e
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited with {proc.returncode} (see {run_dir})")
        time.sleep(0.05)
    raise TimeoutError(f"no matching event within {timeout} s (see {run_dir})")


def grow_once(work: Path, nodes: int, window: int) -> dict:
    import subprocess

    from oobleck_hpc.launch.local import kill_node

    run_dir = work / "grow"
    run_dir.mkdir(parents=True)
    job = work / "grow.yaml"
    job.write_text(yaml.safe_dump(job_dict(run_dir, nodes, 100_000, work / "ckpt-grow", 3)))
    metrics = run_dir / "metrics.jsonl"
    proc = start(job, run_dir, metrics, work / "grow.log")
    try:
        rows = wait_steps(metrics, 2 * window, proc, 300)  # the first window warms up
        before = throughput(rows[window:2 * window])
        t_kill = kill_node(run_dir, "node1")
        wait_event(run_dir, lambda e: e["kind"] == "recovered" and e["t"] > t_kill, proc, 120)
        done = len(read_jsonl(metrics))
        rows = wait_steps(metrics, done + window, proc, 300)
        shrunk = throughput(rows[done:done + window])
        t_grow = time.time()
        out = subprocess.run([sys.executable, "-m", "oobleck_hpc", "grow", str(run_dir),
                              "--nodes", "1"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"oobleck-hpc grow failed: {out.stdout}{out.stderr}")
        new = json.loads((run_dir / "agents.json").read_text()).keys() - {
            f"node{i}" for i in range(nodes)}
        grown = wait_event(run_dir, lambda e: e["kind"] == "recovered" and e["t"] > t_grow
                           and e.get("joined"), proc, 300)
        done = len(read_jsonl(metrics))
        rows = wait_steps(metrics, done + window, proc, 300)
        after = throughput(rows[done:done + window])
    finally:
        stop(proc, run_dir)
    events = read_events(run_dir / "events.jsonl")
    (node,) = new
    started = next(e for e in events if e["kind"] == "agent_started" and e["source"] == node)
    agreed = next(e for e in events if e["kind"] == "agreement_reached" and e["t"] > t_grow
                  and node in e.get("joined", []))
    return {"node": node, "joined": grown["joined"], "generation": grown["generation"],
            "join_s": round(grown["t"] - started["t"], 4),
            "join_round_s": round(grown["t"] - agreed["t"], 4),
            "grow_request_s": round(grown["t"] - t_grow, 4), "phases": grown["phases"],
            "bytes_moved": grown.get("bytes_moved", 0),
            "throughput_before": before, "throughput_shrunk": shrunk, "throughput_after": after,
            "restored_ratio": round(after / before, 4)}


def swap_once(work: Path, nodes: int, window: int) -> dict:
    from oobleck_hpc.launch.local import kill_node

    run_dir = work / "swap"
    run_dir.mkdir(parents=True)
    job = work / "swap.yaml"
    d = job_dict(run_dir, nodes, 100_000, work / "ckpt-swap", 3)
    d["cluster"]["spares"] = 1
    job.write_text(yaml.safe_dump(d))
    metrics = run_dir / "metrics.jsonl"
    proc = start(job, run_dir, metrics, work / "swap.log")
    try:
        wait_steps(metrics, 2 * window, proc, 300)
        t_kill = kill_node(run_dir, "node1")
        swapped = wait_event(run_dir, lambda e: e["kind"] == "recovered" and e["t"] > t_kill,
                             proc, 120)
    finally:
        stop(proc, run_dir)
    return {"swap_s": round(swapped["t"] - t_kill, 4), "lost": swapped["lost"],
            "joined": swapped["joined"], "phases": swapped["phases"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--window", type=int, default=60, help="steps per throughput measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-grow-"))
    grow = grow_once(work, args.nodes, args.window)
    swap = swap_once(work, args.nodes, args.window)
    result = {"join_s": grow["join_s"], "swap_s": swap["swap_s"],
              "throughput_before": grow["throughput_before"],
              "throughput_shrunk": grow["throughput_shrunk"],
              "throughput_after": grow["throughput_after"],
              "restored_ratio": grow["restored_ratio"], "grow": grow, "swap": swap,
              "nodes": args.nodes, "machine": platform.node(), "work": str(work) if args.keep else None}
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
