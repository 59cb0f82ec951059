"""`oobleck-hpc fleet plan FLEET.yaml [--nodes N] [--current NAME=K,...] [--json]`: how the
fleet's nodes would be shared, and what each job would train at.

Builds every job's WAF curve (curves.py: its own planner, its templates once, instantiated for
every node count) and the decision (allocate.py) over the pool's nodes. Prints each job's
nodes, predicted samples/s, FLOP/s and WAF (weight x FLOP/s), the total WAF and the nodes left
idle. --current gives the allocation running now (a job it does not name has 0 nodes: it waits): each
job whose count changes then pays its transition_s x its WAF, amortised over the pool's MTBF
(starting a waiting job too), and the WAF before is printed too.
--json: one object (keys fleet, nodes, mtbf_hours, jobs, total_waf, objective, idle_nodes,
waf_before, seconds), each job with its whole curve (samples_per_s_by_nodes, index = nodes).

`oobleck-hpc fleet status RUN_DIR [--json] [--plot FILE]` tells a fleet run from its events
(status.py; `oobleck-hpc report RUN_DIR` on a fleet's run dir does the same);
`fleet run` (launch/fleet.py: it starts processes) registers itself beside these. `fleet
submit` (a Slurm fleet) is not built yet (issue 32); `oobleck-hpc simulate --fleet`
(fleet/simulate.py) replays the decision on failure traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """`fleet plan` and `fleet status`; returns the fleet's subcommands, to which
    launch/fleet.py adds `fleet run` (it starts processes: the fleet package does not)."""
    p = sub.add_parser("fleet", help="many jobs on one pool of nodes: share it, run it")
    fleet_sub = p.add_subparsers(dest="fleet_command", required=True, metavar="FLEET_COMMAND")
    q = fleet_sub.add_parser("plan", help="each job's nodes, throughput and WAF on the pool")
    q.add_argument("fleet", help="YAML fleet file")
    q.add_argument("--nodes", type=int, default=None, help="the pool's nodes (default: pool.nodes)")
    q.add_argument("--current", default=None, metavar="NAME=K,...",
                   help="the node counts running now (a job not named: 0): moves away from "
                        "them cost (default: a fresh start, nothing moves)")
    q.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    q.set_defaults(func=run)
    s = fleet_sub.add_parser("status", help="a fleet run's jobs, their nodes over time and the "
                             "fleet's WAF (from its events)")
    s.add_argument("run_dir", help="the fleet's run dir (`fleet run --run-dir`)")
    s.add_argument("--json", action="store_true", help="one JSON object instead of text")
    s.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the fleet's WAF and each job's nodes over time into this PNG")
    s.set_defaults(func=status)
    return fleet_sub


def status(args: argparse.Namespace) -> int:
    """`fleet status`, and `oobleck-hpc report` on a fleet's run dir."""
    from oobleck_hpc.fleet.status import format_status, plot_status, read_status
    from oobleck_hpc.sim.report import check_plot_target

    plot = getattr(args, "plot", None)
    if plot:
        check_plot_target(plot)
    rep = read_status(args.run_dir)
    if plot:
        plot_status(rep, plot)
        rep["plot"] = str(plot)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_status(rep))
        if plot:
            print(f"\nplot: {plot}")
    return 0


def parse_current(text: str | None, names: list[str]) -> dict[str, int]:
    from oobleck_hpc.errors import ConfigError

    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, count = part.partition("=")
        if not sep or name not in names or not count.strip().isdigit():
            raise ConfigError("--current", "--current", f"value {part!r} is not NAME=K with "
                              f"NAME a job of the fleet", f"use e.g. {names[0]}=4; the jobs "
                              f"are: {', '.join(names)}")
        out[name] = int(count)
    return {name: out.get(name, 0) for name in names}  # a job not named waits: 0 nodes


def plan_fleet(path: str, nodes: int | None, current_text: str | None = None) -> dict:
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.fleet.allocate import JobCurve, decide
    from oobleck_hpc.fleet.config import load_fleet
    from oobleck_hpc.fleet.curves import job_curve

    if nodes is not None and nodes < 1:
        raise ConfigError("--nodes", "--nodes", f"value {nodes} must be at least 1",
                          "pass the pool's node count")
    t0 = time.perf_counter()
    fleet, jobs = load_fleet(path, nodes)
    current = parse_current(current_text, [j.name for j in jobs])
    n = fleet.pool.nodes
    t1 = time.perf_counter()
    curves = [job_curve(j, n) for j in jobs]
    t2 = time.perf_counter()
    inputs = [JobCurve(c.name, c.waf, min_nodes=j.entry.min_nodes, max_nodes=j.entry.max_nodes,
                       transition_s=j.entry.transition_s, current=current.get(j.name))
              for j, c in zip(jobs, curves)]
    decision = decide(inputs, n, horizon_s=fleet.mtbf_hours * 3600)
    t3 = time.perf_counter()
    rows = []
    for j, c, k, moved in zip(jobs, curves, decision.nodes, decision.moved):
        rows.append({"name": j.name, "job": str(fleet.job_path(j.entry)), "weight": c.weight,
                     "min_nodes": j.entry.min_nodes, "max_nodes": j.entry.max_nodes,
                     "smallest_plan": c.smallest, "nodes": k,
                     "samples_per_s": float(c.samples_per_s[k]),
                     "flops_per_sample": c.flops_per_sample,
                     "flops_per_s": float(c.flops_per_s[k]), "waf": float(c.waf[k]),
                     "current": current.get(j.name), "moved": moved,
                     "curve_seconds": c.seconds,
                     "samples_per_s_by_nodes": c.samples_per_s.tolist()})
    before = (sum(float(c.waf[current[c.name]]) for c in curves
                  if c.name in current and current[c.name] < len(c.waf)) if current else None)
    return {"fleet": fleet.name, "source": path, "nodes": n, "mtbf_hours": fleet.mtbf_hours,
            "jobs": rows, "total_waf": decision.total_waf, "objective": decision.objective,
            "idle_nodes": n - sum(decision.nodes), "waf_before": before,
            "seconds": {"load": t1 - t0, "curves": t2 - t1, "decision": t3 - t2}}


def _print(rep: dict) -> None:
    from oobleck_hpc.records.story import plural

    print(f"fleet {rep['fleet']}: {plural(len(rep['jobs']), 'job')} on "
          f"{plural(rep['nodes'], 'node')}, MTBF {rep['mtbf_hours']:g} h")
    print(f"{'job':<24} {'weight':>6} {'nodes':>5} {'now':>4} {'samples/s':>11} "
          f"{'FLOP/s':>10} {'WAF':>10}")
    for r in rep["jobs"]:
        now = "-" if r["current"] is None else str(r["current"])
        print(f"{r['name']:<24} {r['weight']:>6g} {r['nodes']:>5} {now:>4} "
              f"{r['samples_per_s']:>11.2f} {r['flops_per_s']:>10.3e} {r['waf']:>10.3e}"
              + ("" if r["nodes"] or r["smallest_plan"] is None
                 else f"  (waits: its plans start at {r['smallest_plan']} nodes)"))
    print(f"total WAF {rep['total_waf']:.3e} weighted FLOP/s; "
          f"{plural(rep['idle_nodes'], 'node')} idle")
    if rep["waf_before"] is not None and not any(r["moved"] for r in rep["jobs"]):
        print(f"WAF now {rep['waf_before']:.3e}: no move pays for its pauses over the MTBF")
    elif rep["waf_before"] is not None:
        moved = [r["name"] for r in rep["jobs"] if r["moved"]]
        print(f"WAF now {rep['waf_before']:.3e}; after the moves {rep['total_waf']:.3e} "
              f"({', '.join(moved)} pause their transition_s: net of that, amortised over the "
              f"MTBF, {rep['objective']:.3e})")
    print("WAF: weight x FLOP/s (samples/s x the model's training FLOPs per sample); "
          "samples/s as the planner predicts them")
    t = rep["seconds"]
    print(f"took {sum(t.values()):.2f} s: fleet and jobs {t['load']:.2f} s, curves "
          f"{t['curves']:.2f} s, decision {t['decision'] * 1000:.1f} ms")


def run(args: argparse.Namespace) -> int:
    rep = plan_fleet(args.fleet, args.nodes, args.current)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(rep)
    return 0
