"""`oobleck-hpc run JOB.yaml [--metrics FILE]`: train a job with its launcher.

`launch: local` starts the job's nodes as local process groups (launch/local.py) and trains;
rank 0 prints the plan, progress and a summary. `launch: slurm` jobs are submitted with
`oobleck-hpc submit` instead. Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a job on this machine (launch: local)",
                       description=__doc__.splitlines()[0])
    p.add_argument("job", help="YAML job file")
    p.add_argument("--metrics", default=None,
                   help="append one JSON line per step here (step, loss, samples, seconds, "
                        "plan, generation); default: <run_dir>/metrics.jsonl")
    p.add_argument("--run-dir", default=None, help="override the job's run_dir")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--nodes", type=int, default=None, help="override cluster.nodes")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    import yaml

    from oobleck_hpc.config import load_job
    from oobleck_hpc.errors import ConfigError
    from oobleck_hpc.launch.local import launch_local

    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.nodes is not None:
        overrides["cluster.nodes"] = args.nodes
    if args.run_dir is not None:
        overrides["run_dir"] = args.run_dir
    job = load_job(args.job, overrides)
    if job.cluster.launch != "local":
        raise ConfigError(job.source, "cluster.launch", f"value {job.cluster.launch!r} is not "
                          "run on this machine", "use `oobleck-hpc submit` for Slurm jobs, or "
                          "set cluster.launch: local")
    run_dir = job.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = Path(args.job)
    if overrides:  # the workers read the job with the overrides applied
        fd, name = tempfile.mkstemp(prefix="job-", suffix=".yaml", dir=run_dir)
        with open(fd, "w") as f:
            yaml.safe_dump(json.loads(json.dumps(job.to_dict())), f, sort_keys=False)
        job_path = Path(name)
    metrics = args.metrics or run_dir / "metrics.jsonl"
    return launch_local(job, job_path, metrics=metrics, run_dir=run_dir)
