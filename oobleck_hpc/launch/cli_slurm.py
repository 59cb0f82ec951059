"""`oobleck-hpc submit JOB.yaml`: submit a job to Slurm (submitit; see oobleck_hpc/launch/slurm.py).

Prints the Slurm job id and where its logs go; `--wait` tells the run as it goes (the same lines
as `oobleck-hpc run`: oobleck_hpc/records/story.py, from RUN_DIR/events.jsonl and metrics.jsonl on the
shared filesystem), blocks until the job ends and prints how its agents' step ended (nodes, lost
nodes, exit code) as JSON. `--dry-run` prints the sbatch parameters and the per-node command
without submitting. Imports submitit only when run.

Before anything is submitted, the job's local inputs (data files against the model's
vocabulary, pretrained weights' names and shapes, a model factory's module) are checked as
`oobleck-hpc run` checks them (launch/cli.py check_local_inputs): the submitting host sees the
files the nodes will read (submitit's own files are on that shared filesystem too), and a bad
input is exit 2 here rather than on every node after the allocation.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("submit", help="submit a job to Slurm (one agent per node)",
                              description=__doc__.splitlines()[0])
    p.add_argument("job", help="YAML job file")
    p.add_argument("--nodes", type=int, default=None, help="override cluster.nodes")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its result")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sbatch parameters and the agent command; submit nothing")
    p.set_defaults(func=run)


def register_fleet(fleet_sub: argparse._SubParsersAction) -> None:
    p = fleet_sub.add_parser("submit", help="submit the fleet to Slurm as one allocation: its "
                             "manager and every job inside it",
                             description="Submit the fleet as one Slurm allocation of pool.nodes "
                             "nodes: its batch script runs the fleet's manager (`fleet run "
                             "--slurm`), which starts each job on nodes of the allocation and "
                             "moves nodes between them without a trip through the queue.")
    p.add_argument("fleet", help="YAML fleet file")
    p.add_argument("--run-dir", default=None,
                   help="the fleet's run dir (default: runs/<fleet name>)")
    p.add_argument("--wait", action="store_true",
                   help="wait for the allocation to end, then print the fleet's status")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sbatch parameters and the manager's command; submit nothing")
    p.set_defaults(func=submit_fleet)


def submit_fleet(args: argparse.Namespace) -> int:
    """`fleet submit`: every job's inputs checked, as `submit` does, before anything is
    allocated; exit code with --wait: 0 when every job finished, else the first job's code."""
    import sys
    import time
    from pathlib import Path

    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.fleet.cli import status
    from oobleck_hpc.fleet.config import load_fleet
    from oobleck_hpc.launch import slurm
    from oobleck_hpc.launch.cli import check_local_inputs
    from oobleck_hpc.launch.slurm_driver import FleetDriver

    fleet, entries = load_fleet(args.fleet)
    for entry in entries:
        check_local_inputs(entry.job)
    run_dir = Path(args.run_dir or Path("runs") / fleet.name).absolute()
    if (run_dir / "events.jsonl").exists():
        raise ConfigError("<command line>", "--run-dir", f"value {str(run_dir)!r} holds a "
                          "fleet run already", "give the fleet a new --run-dir")
    if args.dry_run:
        driver = FleetDriver(str(Path(args.fleet).absolute()), str(run_dir))
        print(json.dumps({"sbatch": slurm.fleet_sbatch_parameters(fleet, run_dir),
                          "manager": driver.manager()}, indent=1))
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    submitted = slurm.submit_fleet(fleet, run_dir)
    print(f"submitted fleet {fleet.name} as job {submitted.job_id}: {fleet.pool.nodes} nodes, "
          f"{len(entries)} jobs; run dir {run_dir}; `oobleck-hpc fleet status {run_dir}`",
          flush=True)
    if not args.wait:
        return 0
    while not submitted.done():
        time.sleep(1.0)
    if (run_dir / "events.jsonl").exists():
        status(argparse.Namespace(run_dir=str(run_dir), json=False, plot=None))
    return fleet_exit_code(run_dir, file=sys.stderr)


def fleet_exit_code(run_dir, file=None) -> int:
    """A fleet's exit code, as its `fleet run` returned it (its `fleet_ended` event); 1 when
    the fleet left none (its allocation ended first: see RUN_DIR/submitit)."""
    from oobleck_hpc.records.events import read_events

    path = run_dir / "events.jsonl"
    ended = [e for e in read_events(path) if e.get("kind") == "fleet_ended"] \
        if path.exists() else []
    if not ended:
        print(f"the fleet left no fleet_ended event; see {run_dir}/submitit", file=file)
        return 1
    return int(ended[-1]["code"])


def run(args: argparse.Namespace) -> int:
    import sys

    from oobleck_hpc.records import runs
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch import slurm
    from oobleck_hpc.launch.cli import check_local_inputs

    job = load_job(args.job, {"cluster.nodes": args.nodes} if args.nodes is not None else None)
    check_local_inputs(job)
    if args.dry_run:
        run_dir = job.resolved_run_dir.absolute()
        print(json.dumps({
            "sbatch": slurm.sbatch_parameters(job),
            "agent": slurm.agent_argv(job.slurm.agent_command, python=sys.executable,
                                      job_file=run_dir / "job.yaml", run_dir=run_dir),
        }, indent=1))
        return 0
    with runs.private_files(job.group_access):  # RUN_DIR, job.yaml, submitit's files (records/runs.py)
        submitted = slurm.submit(job)
    run_dir = job.resolved_run_dir.absolute()
    print(f"submitted job {submitted.job_id}: {job.cluster.nodes} nodes; run dir {run_dir}; "
          f"logs {run_dir}/logs and {run_dir}/submitit", flush=True)
    if not args.wait:
        return 0
    import time

    from oobleck_hpc.records import runs
    from oobleck_hpc.launch.local import Console

    console = Console(run_dir / "events.jsonl", run=runs.slurm_run_id(submitted.job_id),
                      metrics=run_dir / "metrics.jsonl", every=job.train.log_every,
                      total=job.train.steps, out=sys.stderr)
    while not submitted.done():
        console.poll()
        time.sleep(0.5)
    result = slurm.wait_result(submitted, run_dir)
    console.poll()
    print(json.dumps(result.to_dict(), indent=1))
    return result.exit_code
