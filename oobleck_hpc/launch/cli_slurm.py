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
