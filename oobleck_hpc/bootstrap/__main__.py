"""`python -m oobleck_hpc.bootstrap COMMAND`: the bootstrap's command-line side, run by srun.

    discover --run-dir DIR [--members K]
                                  one task per node, under `srun --mpi=pmix`: agree on the roster
                                  and write DIR/roster.json + DIR/discovery.json (discovery.py);
                                  with K > 0 the nodes after the first K are spares
    probe --run-dir DIR [--job F] [--seconds S] [--first-run-exit CODE]
                                  a small real per-node program standing in for the agent in
                                  launch tests: reads the discovery of this job run, binds its
                                  published port, records its NodeEnvironment in
                                  DIR/probe/NODE.json, then beats (DIR/probe/NODE.beats, one line
                                  every 0.2 s) for S seconds, noting any SIGUSR2/SIGTERM it gets;
                                  exits CODE on a job's first run (restart 0), else 0 -- and
                                  then, as a training run's rank 0 does, records the run
                                  finished (its `run_finished` event: the verdict, records/runs.py)
    discover-step --run-dir DIR --nodes A,B,.. [--min-nodes K] [--members K] [--mpi M] [--log F]
                                  run the discovery step from the batch script, leaving out
                                  nodes that cannot run a step (discovery.run_discovery_step);
                                  prints the nodes it ran on; exit 75 with fewer than K left
    run-dir JOB.yaml              print the job's run directory (for slurm/train.sbatch)
    min-nodes JOB.yaml            print the fewest nodes the job's plan accepts, (f + 1) * n0
                                  (discover-step's --min-nodes)
    members JOB.yaml              print generation 0's node count for discover-step's --members:
                                  cluster.nodes for a job with cluster.spares, else 0 (all)
    umask JOB.yaml                print the umask the job's files are made under: 077, or 027
                                  with its group_access (oobleck_hpc/records/runs.py, "Private")
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from pathlib import Path

from oobleck_hpc.bootstrap.environment import detect
from oobleck_hpc.diagnostics import configure


def _discover(args: argparse.Namespace) -> int:
    from oobleck_hpc.bootstrap.discovery import discover

    t0 = time.monotonic()
    found = discover(args.run_dir, members=args.members)
    env = detect()
    if env.task_rank == 0:
        print(f"discovery: job {found.job_id} restart {found.restart_count}: "
              f"{len(found.records)} nodes {[r.node for r in found.records]}, store "
              f"{found.store[0]}:{found.store[1]}, digest {found.digest}, "
              f"{time.monotonic() - t0:.2f} s", flush=True)
    return 0


def _probe(args: argparse.Namespace) -> int:
    from oobleck_hpc.bootstrap.discovery import wait_for_discovery

    env = detect()
    if args.job:
        from oobleck_hpc.config import load_job
        load_job(args.job)  # the agent's first act: the job file must load
    found = wait_for_discovery(args.run_dir, env.job_id, env.restart_count)
    me = found.roster.address(env.node)
    with socket.socket() as listener:  # the published port must be ours to bind
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((me.host, me.port))
        listener.listen()
        out = Path(args.run_dir) / "probe"
        out.mkdir(parents=True, exist_ok=True)
        signals: list[str] = []
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: signals.append(signal.Signals(s).name))
        record = {"env": env.as_dict(), "digest": found.digest, "port": me.port,
                  "roster": list(found.roster.names), "store": list(found.store),
                  "pid": __import__("os").getpid(), "started": time.time()}
        (out / f"{env.node}.json").write_text(json.dumps(record, indent=1) + "\n")
        end = time.monotonic() + args.seconds
        with open(out / f"{env.node}.beats", "a") as beats:
            while time.monotonic() < end:
                beats.write(f"{time.time():.3f} {env.restart_count} {','.join(signals)}\n")
                beats.flush()
                time.sleep(0.2)
        record["finished"] = time.time()
        record["signals"] = signals
        (out / f"{env.node}.json").write_text(json.dumps(record, indent=1) + "\n")
    code = args.first_run_exit if env.restart_count == 0 else 0
    if code == 0:  # the job's verdict is its record (oobleck_hpc/records/runs.py), not this exit code
        from oobleck_hpc.records.events import EventLog

        EventLog(Path(args.run_dir) / "events.jsonl", source=f"{env.node}/probe").emit(
            "run_finished", steps=1, total=1, model="probe")
    print(f"probe {env.node}: done (restart {env.restart_count}), exit {code}", flush=True)
    return code


def _run_dir(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job

    print(load_job(args.job).resolved_run_dir)
    return 0


def _discover_step(args: argparse.Namespace) -> int:
    from oobleck_hpc.bootstrap.discovery import TooFewNodes, run_discovery_step
    from oobleck_hpc.errors import EXIT_REQUEUE, EXIT_UNRECOVERABLE

    try:
        nodes = run_discovery_step(args.run_dir, args.nodes.split(","), python=sys.executable,
                                   mpi=args.mpi, log=args.log or "/dev/null",
                                   min_nodes=args.min_nodes, members=args.members)
    except TooFewNodes as e:
        print(f"discovery: {e}; asking for a requeue", file=sys.stderr)
        return EXIT_REQUEUE
    except RuntimeError as e:
        print(f"discovery: {e}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    print(",".join(nodes))
    return 0


def _min_nodes(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch.slurm import min_nodes

    print(min_nodes(load_job(args.job)))
    return 0


def _members(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch.slurm import members

    print(members(load_job(args.job)))
    return 0


def _umask(args: argparse.Namespace) -> int:
    from oobleck_hpc.records import runs
    from oobleck_hpc.config import load_job

    print(f"{runs.umask(load_job(args.job).group_access):03o}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_hpc.bootstrap",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("discover", help="agree on the roster (one task per node, under MPI)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--members", type=int, default=0,
                   help="generation 0's node count; the nodes after it are spares (0: none)")
    p.set_defaults(func=_discover)
    p = sub.add_parser("probe", help="a per-node test program standing in for the agent")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--job", default=None, help="a job YAML to load first (as the agent does)")
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--first-run-exit", type=int, default=0,
                   help="exit code on the job's first run (75: ask for a requeue)")
    p.set_defaults(func=_probe)
    p = sub.add_parser("discover-step", help="run the discovery step (from a batch script)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--nodes", required=True, help="comma-separated node names")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--members", type=int, default=0,
                   help="generation 0's node count; the nodes after it are spares (0: none)")
    p.add_argument("--mpi", default="pmix")
    p.add_argument("--log", default=None, help="the step's output file")
    p.set_defaults(func=_discover_step)
    p = sub.add_parser("run-dir", help="print a job's run directory")
    p.add_argument("job")
    p.set_defaults(func=_run_dir)
    p = sub.add_parser("min-nodes", help="print the fewest nodes a job's plan accepts")
    p.add_argument("job")
    p.set_defaults(func=_min_nodes)
    p = sub.add_parser("members", help="print generation 0's node count (0: every node)")
    p.add_argument("job")
    p.set_defaults(func=_members)
    p = sub.add_parser("umask", help="print the umask of the job's files (077, 027: group_access)")
    p.add_argument("job")
    p.set_defaults(func=_umask)
    args = parser.parse_args(argv)
    configure("WARNING")  # (OOBLECK_LOG_LEVEL, from the CLI, else WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
