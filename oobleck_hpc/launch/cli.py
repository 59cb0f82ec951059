"""`oobleck-hpc run JOB.yaml [--metrics FILE]`: train a job with its launcher. (The commands that
act on a running job -- kill-node, drain, grow, watch -- are in operate/cli.py.)

`launch: local` starts the job's nodes as local process groups (launch/local.py) and trains;
rank 0 prints the plan, progress and a summary. `launch: slurm` jobs are submitted with
`oobleck-hpc submit` instead; `--on-nodes` runs any job's agents as steps on named nodes of the
Slurm allocation the command runs in (what a Slurm fleet runs for each job: launch/fleet.py). Nothing heavy is imported until the command runs.

The command is the job's main process for the watchdog (`oobleck-hpc watch RUN_DIR`; the
contract: operate/liveness.py): it takes RUN_DIR/job.lock first (a second copy of the job
refuses to start), records how to start it again (RUN_DIR/run.json), and how it ended
(RUN_DIR/exit.json). A job that exits 75 (guarantee exceeded, or SIGTERM/SIGUSR2: checkpoint
on disk) is started again and resumes from its checkpoint, at most --max-requeues times
(launch/requeue.py).

Each invocation is a new run with its own id (oobleck_hpc/records/runs.py): the previous run's records
in RUN_DIR move to RUN_DIR/history/<its id>/ first, so runs never mix. A watchdog restart
(OOBLECK_RESTART_COUNT > 0) continues the run it restarts.
"""

from __future__ import annotations

import argparse
import sys

from oobleck_hpc.errors import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_UNRECOVERABLE,
    ConfigError,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a job on this machine (launch: local)",
                       description="Train a job on this machine (cluster.launch: local): "
                       "start its nodes as local processes, tell the run on the console, and "
                       "start it again from its checkpoint when it exits 75.")
    p.add_argument("job", help="YAML job file")
    p.add_argument("--metrics", default=None,
                   help="append one JSON line per step here (step, loss, samples, seconds, "
                        "plan, generation); default: <run_dir>/metrics.jsonl")
    p.add_argument("--run-dir", default=None, help="override the job's run_dir")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--nodes", type=int, default=None, help="override cluster.nodes")
    p.add_argument("--max-requeues", type=int, default=3, metavar="N",
                   help="start the job again at most N times when it exits 75 (default 3)")
    p.add_argument("--on-nodes", default=None, metavar="N1,N2,...",
                   help="inside a Slurm allocation: run the job's agents as steps on these of "
                        "its nodes (what `fleet submit` runs for each job); sets --nodes, any "
                        "cluster.launch, never requeued (exit 75 is its caller's to act on)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import os

    from oobleck_hpc.records import runs
    from oobleck_hpc.config import load_job
    from oobleck_hpc.operate.liveness import JobLock, write_run_record

    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    on_nodes = [n for n in (args.on_nodes or "").split(",") if n] or None
    if args.on_nodes is not None and not on_nodes:
        raise ConfigError("<command line>", "--on-nodes", f"value {args.on_nodes!r} names no "
                          "node", "give the allocation's nodes, comma-separated")
    if args.nodes is not None or on_nodes:
        overrides["cluster.nodes"] = len(on_nodes) if on_nodes else args.nodes
    if args.run_dir is not None:
        overrides["run_dir"] = args.run_dir
    job = load_job(args.job, overrides)
    if job.cluster.launch != "local" and not on_nodes:
        raise ConfigError(job.source, "cluster.launch", f"value {job.cluster.launch!r} is not "
                          "run on this machine", "use `oobleck-hpc submit` for Slurm jobs, or "
                          "set cluster.launch: local")
    check_local_inputs(job)
    if args.max_requeues < 0:
        raise ConfigError("<command line>", "--max-requeues", f"value {args.max_requeues} is "
                          "negative", "use 0 to never requeue")
    # Everything of the run -- its records, the agents', the workers' -- is the user's alone, or
    # also the group's to read (the job's group_access: records/runs.py, "Private").
    run_dir = runs.make_run_dir(job.resolved_run_dir, job.group_access)
    with runs.private_files(job.group_access), JobLock(run_dir):
        begin_run(run_dir, job.group_access)
        runs.write_job(run_dir, job, "run")
        write_run_record(run_dir, [sys.executable, "-m", "oobleck_hpc", *sys.argv[1:]],
                         cwd=os.getcwd(), checkpoint_dir=job.checkpoint.dir)
        code = EXIT_UNRECOVERABLE
        try:
            code = _launch_with_requeue(args, job, overrides, run_dir, on_nodes)
        finally:
            end_run(run_dir, code, args.metrics)
        return code


def end_run(run_dir, code: int, metrics=None) -> None:
    """Record how the run ended: RUN_DIR/exit.json (what `watch` reads) and a `run_ended` event
    (the console tells a run that did not finish), both with the run's verdict
    (oobleck_hpc/records/runs.py: finished only when its last step is committed)."""
    from oobleck_hpc.records import runs
    from oobleck_hpc.records.events import EventLog
    from oobleck_hpc.operate.liveness import record_exit
    from oobleck_hpc.records.story import Story

    out = runs.outcome(run_dir, metrics=metrics)
    reason = _EXIT_REASONS.get(code, f"exit {code}")
    record_exit(run_dir, code, reason, out)
    log = EventLog(run_dir / "events.jsonl", source="launcher")
    event = log.emit("run_ended", code=code, reason=reason, finished=out.finished,
                     outcome=out.describe(), last_step=out.last_step, total=out.total)
    log.close()
    for line in Story().feed(event):  # the console's last line (after its last poll)
        print(line, flush=True)


def begin_run(run_dir, group_access: bool = False) -> str:
    """Make this invocation RUN_DIR's current run (a new id, unless a watchdog restart
    continues one) and name it in OOBLECK_RUN_ID for every agent and worker."""
    import os

    from oobleck_hpc.records import runs

    run_id = os.environ.get("OOBLECK_RUN_ID") or (
        runs.read_run_id(run_dir) if runs.attempt() > 0 else "") or runs.new_run_id()
    runs.begin(run_dir, run_id, group_access)
    os.environ["OOBLECK_RUN_ID"] = run_id
    return run_id


def check_local_inputs(job) -> None:
    """What every worker of a local job would reject, checked here before any process starts:
    the parts of the job that name things on this machine (a model factory's module, the
    transformers package of a model.hf job, its pretrained weights' tensor names and shapes,
    the data's files) and whether the data fits the
    model (every token id below its vocabulary size). load_job cannot check them, as a Slurm
    job is loaded where they may not exist."""
    from oobleck_hpc.data import check_data

    if job.model.hf is not None:  # sizes from its config.json, no torch; transformers needed
        from oobleck_hpc.models.hf_config import hf_arch, require_transformers

        require_transformers(job.source)
        arch = hf_arch(job.model.hf, job.source)
        vocab_size, seq_len = arch.vocab_size, arch.max_positions
        if job.model.weights is not None:  # names and shapes from the files' headers
            from oobleck_hpc.models.base import build_model

            model = build_model(job.model, job.source)
            model.weights.check(model)
    elif job.model.factory is None:  # a built-in GPT: its sizes are data, no torch needed
        from oobleck_hpc.models.configs import GPT_CONFIGS

        cfg = GPT_CONFIGS[job.model.name]
        vocab_size, seq_len = cfg.vocab_size, cfg.seq_len
    else:  # the error every worker would raise, said once here
        from oobleck_hpc.models.base import build_model

        model = build_model(job.model, job.source)
        vocab_size, seq_len = model.vocab_size, model.seq_len
    check_data(job.data, vocab_size, job.data.seq_len or seq_len, job.source)


_EXIT_REASONS = {EXIT_OK: "finished", EXIT_BAD_INPUT: "bad input: not requeued",
                 EXIT_UNRECOVERABLE: "unrecoverable error",
                 EXIT_REQUEUE: "requeues exhausted; resume from the latest checkpoint"}


def _launch_with_requeue(args: argparse.Namespace, job, overrides: dict, run_dir,
                         on_nodes: list[str] | None) -> int:
    import json
    import os
    import tempfile
    from pathlib import Path

    import yaml

    from oobleck_hpc.config import load_job
    from oobleck_hpc.records.events import EventLog
    from oobleck_hpc.launch.local import Console, LocalRun
    from oobleck_hpc.launch.requeue import run_with_requeue

    metrics = Path(args.metrics or run_dir / "metrics.jsonl")
    if args.metrics:  # outside the run directory: this run's steps only
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text("")
    events = EventLog(run_dir / "events.jsonl", source="launcher")
    events.emit("run_started", job=job.name, model=job.model.name, steps=job.train.steps,
                nodes=job.cluster.nodes, gpus_per_node=job.cluster.gpus_per_node,
                launch="local" if on_nodes is None else "slurm-steps", pid=os.getpid(),
                on_nodes=on_nodes or [])
    console = Console(run_dir / "events.jsonl")

    def launch(attempt) -> int:
        this, ov = job, dict(overrides)
        if attempt.index > 0:
            # Requeued: on the nodes that are left; injected `faults:` belong to the first run.
            ov["cluster.nodes"], ov["faults"] = attempt.nodes, []
            this = load_job(args.job, ov)
        job_path = Path(args.job)
        if ov:  # the workers read the job with the overrides applied
            fd, name = tempfile.mkstemp(prefix="job-", suffix=".yaml", dir=run_dir)
            with open(fd, "w") as f:
                yaml.safe_dump(json.loads(json.dumps(this.to_dict())), f, sort_keys=False)
            job_path = Path(name)
        run = LocalRun(this, job_path, run_dir, metrics, console=console, on_nodes=on_nodes)
        code = run.run()
        attempt.stopped = run.stopped
        return code

    from oobleck_hpc.launch.slurm import min_nodes

    code, _ = run_with_requeue(launch, nodes=job.cluster.nodes, run_dir=run_dir,
                               max_requeues=0 if on_nodes else args.max_requeues,
                               min_nodes=min_nodes(job),
                               events=events)
    console.poll()
    return code
