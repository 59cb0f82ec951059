"""`oobleck-hpc simulate FILE`: goodput of oobleck vs restart vs redundant on a failure trace.

FILE is either a scenario (YAML with a top-level `simulation:` key: published measurements, e.g.
examples/bert-large-paper.yaml) or a job file (our planner and the job's profile; an analytic
profile with `profile.analytic: true` and `profile.device` answers for clusters we do not have).

    oobleck-hpc simulate examples/bert-large-paper.yaml
    oobleck-hpc simulate examples/gpt3-175b-1024gpu.yaml --every 60 --duration 168
    oobleck-hpc simulate JOB.yaml --mtbf 3.1 --per cluster --policies oobleck,restart --json
    oobleck-hpc simulate JOB.yaml --trace cluster-log.csv --plot goodput.png
    oobleck-hpc simulate JOB.yaml --every 60 --growth --spares 2 --replace-after 30
    oobleck-hpc simulate JOB.yaml --every 60 --policies oobleck,recycle

--policies ...,recycle adds a ReCycle-like policy (sim/recycle.py: no re-planning after a loss,
the lost node's micro-batches re-routed to its data-parallel peers, filling their bubbles).

--growth compares the oobleck policy on the same failures three ways: shrinking only, with
--spares S idle nodes (each of the first S losses is answered by a spare swapped in by the
loss's own round, --detect-s after it) and with a replacement node arriving --replace-after
minutes (default 30) after each loss; a joining node costs the policy's join (regroup + its
layers' transfer).

--fleet FLEET.yaml replays one trace over the fleet's pool (pool.nodes) for three policies:
the fleet manager (fleet/simulate.py: each job recovers in place, then the same decision as
`fleet plan` moves nodes between jobs when it pays), every job on its own (today), and
checkpoint-restart per job; it prints each one's WAF (weighted FLOP/s kept) and its ratio to
every job on its own; --plot draws the WAF over time and each job's nodes. Default duration
168 h (one week); --policies takes a subset of fleet,own,restart.

    oobleck-hpc simulate --fleet examples/fleet-128nodes.yaml --mtbf 6335 --per node \
        --replace-after 240 --plot fleet.png

--plot FILE (.png, .svg or .pdf) draws goodput over time per policy -- the work that is kept,
so a restart's lost work shows -- with the failures marked; the path is checked before the
simulation starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from oobleck_hpc.errors import EXIT_BAD_INPUT, ConfigError

_ALL = ("oobleck", "restart", "redundant")
_OPT_IN = ("recycle",)
"""Policies run only when --policies names them (job files only: they need the planner)."""
_FLEET = ("fleet", "own", "restart")


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="goodput of oobleck vs checkpoint-restart vs "
                              "redundancy on a failure trace",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="job YAML, or scenario YAML (top-level "
                   "'simulation:'); not with --fleet")
    p.add_argument("--fleet", metavar="FLEET.yaml",
                   help="a fleet file: the fleet manager vs every job on its own vs "
                   "checkpoint-restart, on one trace over the pool (see below)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="CSV (time,event,node) or JSONL failure trace to replay")
    src.add_argument("--mtbf", type=float, metavar="HOURS",
                     help="exponential failures with this mean time between failures")
    src.add_argument("--every", type=float, metavar="MINUTES", help="one failure every MINUTES")
    p.add_argument("--burst", type=int, default=1, metavar="K",
                   help="with --mtbf: correlated failures, K neighbouring nodes at once "
                   "(a rack, a switch), bursts at the --mtbf of the cluster")
    p.add_argument("--per", choices=("cluster", "node"), default="cluster",
                   help="--mtbf is of the whole cluster (default) or of each node")
    p.add_argument("--replace-after", type=float, metavar="MINUTES",
                   help="a replacement node joins this long after each generated failure")
    p.add_argument("--growth", action="store_true",
                   help="compare oobleck shrinking only, with --spares, and with replacements "
                   "after --replace-after minutes (default 30), on the same failures")
    p.add_argument("--spares", type=int, default=1, metavar="S",
                   help="idle spare nodes of --growth (default 1)")
    p.add_argument("--time-unit", choices=("s", "ms"), default="s",
                   help="time unit of a headerless CSV trace (the Oobleck artifact's are ms)")
    p.add_argument("--policies", default=None,
                   help="comma-separated subset of oobleck,restart,redundant (the default), "
                   "recycle (ReCycle-like, job files only); with --fleet of fleet,own,restart")
    p.add_argument("--duration", type=float, metavar="HOURS",
                   help="simulated time (default: the scenario's, or 24 h for a job)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated traces")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="FILE",
                   help="write a plot of goodput over time per policy, failures marked "
                   "(.png, .svg or .pdf)")
    g = p.add_argument_group("recovery costs of planner-driven runs (job files)")
    g.add_argument("--detect-s", type=float, help="failure detection + agreement "
                   "(default: fault_tolerance.lease_s)")
    g.add_argument("--regroup-s", type=float, default=2.0, help="re-forming process groups")
    g.add_argument("--restart-s", type=float, default=120.0,
                   help="restart without checkpoint read (requeue, launch, init)")
    g.add_argument("--storage-gbps", type=float, default=20.0,
                   help="aggregate checkpoint storage bandwidth, GB/s")
    p.set_defaults(func=main)


def _fail(key: str, value, problem: str, fix: str) -> None:
    raise ConfigError("oobleck-hpc simulate", key, f"value {value!r} {problem}", fix)


def make_trace(args: argparse.Namespace, nodes: tuple[str, ...], duration_s: float,
               replace_s: float | None, scenario=None):
    """The failure trace the options ask for (--trace, --every, --mtbf [--per, --burst]), else
    the scenario's own, cut at `duration_s`."""
    from oobleck_hpc.sim.trace import bursts, exponential, fixed_interval, load_trace

    if args.burst < 1:
        _fail("--burst", args.burst, "must be >= 1", "give the nodes that fail together")
    if args.burst > 1 and not args.mtbf:
        _fail("--burst", args.burst, "needs --mtbf", "add --mtbf HOURS (between bursts)")
    if args.trace:
        trace = load_trace(args.trace, nodes, time_unit=args.time_unit)
    elif args.every:
        trace = fixed_interval(nodes, 60.0 * args.every, duration_s, args.seed, replace_s)
    elif args.mtbf and args.burst > 1:
        trace = bursts(nodes, 3600.0 * args.mtbf, args.burst, duration_s, args.seed, replace_s)
    elif args.mtbf:
        trace = exponential(nodes, 3600.0 * args.mtbf, duration_s, args.seed, args.per,
                            replace_s)
    elif scenario is not None and scenario.every_minutes:
        trace = fixed_interval(nodes, 60.0 * scenario.every_minutes, duration_s, args.seed)
    elif scenario is not None and scenario.mtbf_hours:
        trace = exponential(nodes, 3600.0 * scenario.mtbf_hours, duration_s, args.seed)
    else:
        raise ConfigError(args.file or args.fleet, "<failures>", "gives no failure trace",
                          "pass --trace FILE, --mtbf HOURS or --every MINUTES")
    return trace.until(duration_s)


def main(args: argparse.Namespace) -> int:
    if (args.fleet is None) == (args.file is None):
        _fail("FILE", args.file, "and --fleet: give exactly one", "pass a job or scenario "
              "file, or --fleet FLEET.yaml")
    from oobleck_hpc.sim import run_policies
    from oobleck_hpc.sim.report import PlotError, check_plot_target, format_table, plot, to_json
    from oobleck_hpc.sim.scenario import is_scenario_file, load_scenario, scenario_backends
    from oobleck_hpc.sim.trace import node_names

    default = _FLEET if args.fleet else _ALL
    known = _FLEET if args.fleet else _ALL + _OPT_IN
    text = args.policies or ",".join(default)
    policies = tuple(x.strip() for x in text.split(",") if x.strip())
    for name in policies:
        if name not in known:
            _fail("--policies", name, "is not a policy", f"use a subset of {','.join(known)}")
    if not policies:
        _fail("--policies", text, "names no policy", f"use e.g. {','.join(default)}")
    for key in ("mtbf", "every", "duration", "replace_after", "regroup_s", "restart_s",
                "storage_gbps", "detect_s"):
        v = getattr(args, key)
        if v is not None and not v > 0 and not (key in ("regroup_s", "detect_s") and v == 0):
            _fail("--" + key.replace("_", "-"), v, "must be positive", "give a positive number")
    if args.plot:  # before anything is simulated or printed
        try:
            check_plot_target(args.plot)
        except PlotError as e:
            print(f"oobleck-hpc simulate: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.fleet is not None:
        return simulate_fleet(args, policies)

    scenario = load_scenario(args.file) if is_scenario_file(args.file) else None
    if scenario is not None:
        missing = [p for p in policies if p not in scenario.policies]
        if missing:
            _fail("--policies", missing[0], f"is not in scenario {args.file}",
                  f"use a subset of {','.join(scenario.policies)}")
        n_nodes = scenario.nodes
        duration_h = args.duration or scenario.duration_hours
        name = scenario.name
        job_line = (f"{name}, {n_nodes} nodes, global batch "
                    f"{scenario.samples_per_iteration:g} samples")
    else:
        from oobleck_hpc.config import load_job

        job = load_job(args.file)
        n_nodes = job.cluster.nodes
        duration_h = args.duration or 24.0
        name = job.name
    duration_s = duration_h * 3600.0
    nodes = node_names(n_nodes)
    if args.spares < 0:
        _fail("--spares", args.spares, "must be >= 0", "give the number of idle spare nodes")
    if args.growth:
        policies = ("oobleck",)  # the variants below are of the oobleck policy
    # --growth builds its replacements on the plain trace (the same failures for every variant)
    replace = (None if args.replace_after is None or args.growth
               else 60.0 * args.replace_after)
    trace = make_trace(args, nodes, duration_s, replace, scenario)

    if scenario is not None:
        backends = scenario_backends(scenario)
        subject = scenario.description or name
    else:
        from oobleck_hpc.profiling import resolve_profile
        from oobleck_hpc.sim.planner_backend import CostParams, planner_backends

        params = CostParams(detect_s=args.detect_s, regroup_s=args.regroup_s,
                            restart_base_s=args.restart_s, storage_bw=args.storage_gbps * 1e9)
        profile = resolve_profile(job)
        backends = planner_backends(job, profile, params,
                                    trace.mean_failure_interval_s(duration_s), policies)
        subject = (f"{job.model.name} on {n_nodes} nodes x {job.cluster.gpus_per_node} GPUs "
                   f"({profile.fingerprint.device_name}, {profile.fingerprint.source} profile), "
                   f"global batch {job.train.global_microbatches * job.train.microbatch_size}")
        job_line = f"{name}: {subject}"
    if args.growth:
        from oobleck_hpc.sim import POLICIES, simulate

        detect_s = args.detect_s if args.detect_s is not None else (
            job.fault_tolerance.lease_s if scenario is None else 0.0)
        after_min = args.replace_after or 30.0
        variants = {
            "oobleck, shrink only": trace,
            f"oobleck, {args.spares} spare{'s' if args.spares != 1 else ''}":
                trace.with_arrivals(detect_s, args.spares),
            f"oobleck, replaced after {after_min:g} min": trace.with_arrivals(60.0 * after_min),
        }
        backend, kw = backends["oobleck"]
        results = {label: simulate(POLICIES["oobleck"](backend, **kw), tr.until(duration_s),
                                   duration_s) for label, tr in variants.items()}
    else:
        results = run_policies(backends, trace, duration_s, policies)
    title = (f"{subject}\n{trace.description}; {duration_h:g} h simulated, "
             f"{trace.failures} failures")
    if args.json:
        meta = {"file": args.file, "subject": subject, "trace": trace.description,
                "duration_s": duration_s, "failures": trace.failures, "seed": args.seed}
        print(to_json(results, meta))
    else:
        print(format_table(results, title))
    if args.plot:
        failure_rate = (f"{trace.description}: {trace.failures} failures in {duration_h:g} h "
                        "simulated")
        return write_plot(args, lambda: plot(
            results, args.plot, job_line, failure_rate,
            [e.time_s for e in trace.events if e.kind == "fail"],
            [e.time_s for e in trace.events if e.kind == "add"]))
    return 0


def write_plot(args: argparse.Namespace, write: Callable[[], None]) -> int:
    """Run `write` (it writes --plot): 0 and where it went, or exit 2 with the reason."""
    from oobleck_hpc.sim.report import PlotError

    try:
        write()
    except PlotError as e:
        print(f"oobleck-hpc simulate: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.json:
        print(f"plot written to {args.plot}")
    return 0


def simulate_fleet(args: argparse.Namespace, policies: tuple[str, ...]) -> int:
    """`oobleck-hpc simulate --fleet FLEET.yaml ...` (main parsed and checked the options):
    the fleet policies (fleet/simulate.py) on one trace over the pool, as a table or JSON, and
    --plot."""
    from oobleck_hpc.fleet.report import format_table, plot, to_json
    from oobleck_hpc.fleet.simulate import ceiling_waf, fleet_jobs, simulate_policies
    from oobleck_hpc.sim.trace import node_names

    if args.growth:
        _fail("--growth", True, "is of one job, not a fleet", "leave out --growth or --fleet")
    fleet, jobs = fleet_jobs(args.fleet)
    duration_h = args.duration or 168.0
    duration_s = 3600.0 * duration_h
    replace = None if args.replace_after is None else 60.0 * args.replace_after
    trace = make_trace(args, node_names(fleet.pool.nodes), duration_s, replace)
    results = simulate_policies(jobs, trace, duration_s, 3600.0 * fleet.mtbf_hours, policies)
    ceiling = ceiling_waf(jobs, trace, duration_s)
    weights = " / ".join(f"{j.name} x{j.weight:g}" for j in jobs)
    title = (f"fleet {fleet.name}: {len(jobs)} jobs ({weights}) on {fleet.pool.nodes} nodes\n"
             f"{trace.description}; {duration_h:g} h simulated, {trace.failures} failures")
    if args.json:
        meta = {"fleet": args.fleet, "nodes": fleet.pool.nodes, "trace": trace.description,
                "duration_s": duration_s, "failures": trace.failures, "seed": args.seed,
                "mtbf_hours": fleet.mtbf_hours}
        print(to_json(results, meta, ceiling))
    else:
        print(format_table(results, title, ceiling))
    if args.plot:
        return write_plot(args, lambda: plot(
            results, args.plot, title, [e.time_s for e in trace.events if e.kind == "fail"],
            ceiling))
    return 0
