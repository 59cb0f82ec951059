"""`oobleck-hpc run JOB.yaml [--metrics FILE]`: train a job with its launcher;
`oobleck-hpc kill-node RUN_DIR NODE`: kill a node of a running local job from another shell;
`oobleck-hpc drain RUN_DIR|JOB_ID NODE...`: a node leaves a running job at a step boundary;
`oobleck-hpc grow RUN_DIR|JOB_ID --nodes K`: add K nodes to a running job (they join in place;
under Slurm through a replacement job).

`launch: local` starts the job's nodes as local process groups (launch/local.py) and trains;
rank 0 prints the plan, progress and a summary. `launch: slurm` jobs are submitted with
`oobleck-hpc submit` instead. Nothing heavy is imported until the command runs.

The command is the job's main process for the watchdog (`oobleck-hpc watch RUN_DIR`,
launch/watch.py): it takes RUN_DIR/job.lock first (a second copy of the job refuses to start),
records how to start it again (RUN_DIR/run.json), and how it ended (RUN_DIR/exit.json). A job
that exits 75 (guarantee exceeded, or SIGTERM/SIGUSR2: checkpoint on disk) is started again and
resumes from its checkpoint, at most --max-requeues times (launch/requeue.py).

Each invocation is a new run with its own id (oobleck_hpc/runs.py): the previous run's records
in RUN_DIR move to RUN_DIR/history/<its id>/ first, so runs never mix. A watchdog restart
(OOBLECK_RESTART_COUNT > 0) continues the run it restarts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from oobleck_hpc.errors import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_UNCONFIRMED,
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
    p.set_defaults(func=_run)

    k = sub.add_parser("kill-node", help="kill one node (agent + workers) of a running local job",
                       description="Kill one node of a running `oobleck-hpc run` job from another "
                       "shell: SIGKILL (or --signal STOP: a hang) to the node's agent process "
                       "group, as when a machine dies. The survivors recover in place.")
    k.add_argument("run_dir", help="the job's run directory (holds agents.json)")
    k.add_argument("node", help="node name, e.g. node1")
    k.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "TERM"],
                   help="KILL: a crash (default); STOP: a hang; TERM: ask the node to stop")
    k.set_defaults(func=_kill_node)

    d = sub.add_parser("drain", help="let nodes leave a running job at a step boundary",
                       description="Ask nodes of a running job to leave it gracefully (for "
                       "maintenance, or ahead of a preemption): each finishes the step, leaves at "
                       "the next step boundary with nothing replayed, and the others reconfigure "
                       "without it (elastic/drain.py). Under Slurm an administrator's `scontrol "
                       "update nodename=NODE state=drain` does the same. A drain the survivors "
                       "cannot absorb (a layer would be left on no node) is refused; with --force "
                       "the job then stops with a checkpoint of that step and is requeued without "
                       "the nodes.")
    d.add_argument("run_dir", metavar="RUN_DIR|JOB_ID",
                   help="the job's run directory, or a Slurm job id")
    d.add_argument("nodes", nargs="+", metavar="NODE", help="node names (as in its roster)")
    d.add_argument("--force", action="store_true",
                   help="if refused: stop the job with a checkpoint, requeue it without the nodes")
    d.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the job's verdict (default: return at once)")
    d.set_defaults(func=_private(_drain))

    g = sub.add_parser("grow", help="add nodes to a running job (they join in place)",
                       description="Add K nodes to a running job: a local job's launcher starts "
                       "them; a Slurm job gets a replacement job of K nodes (the job's sbatch "
                       "parameters, the time it has left), which ends with it. They join at the "
                       "next step boundary while the job runs on fewer nodes than it started "
                       "with (after a loss), receive their layers from the members and train; "
                       "otherwise they wait as spares and are swapped in at the next loss.")
    g.add_argument("run_dir", metavar="RUN_DIR|JOB_ID",
                   help="the job's run directory, or a Slurm job id")
    g.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes to add (default 1)")
    g.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds until they trained their first step (default: "
                        "return once their agents started, or the replacement job was submitted)")
    g.add_argument("--job", default=None, metavar="JOB.yaml",
                   help="a Slurm job's job file (default: RUN_DIR/job.yaml, written by submit)")
    g.add_argument("--reason", default="grown by hand",
                   help="why (recorded in the replacement_submitted event)")
    g.set_defaults(func=_private(_grow))


def _private(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command`, creating files for the user alone (runs.private_files): the drain and grow
    requests, a replacement job's submitit files. (`run` takes the job's group_access.)"""
    def run(args: argparse.Namespace) -> int:
        from oobleck_hpc import runs

        with runs.private_files():
            return command(args)

    return run


def _kill_node(args: argparse.Namespace) -> int:
    import signal

    from oobleck_hpc.launch.kill import kill_node  # (only these: it acts at once)
    from oobleck_hpc.story import KILLED

    sig = f"SIG{args.signal}"
    try:
        kill_node(args.run_dir, args.node, getattr(signal, sig))
    except (FileNotFoundError, KeyError, ProcessLookupError) as e:
        print(f"oobleck-hpc kill-node: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.node} of {args.run_dir} {KILLED[sig]} ({sig} to its agent and workers)")
    return 0


def _drain(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from oobleck_hpc.elastic.drain import request_drain
    from oobleck_hpc.elastic.wire import Roster
    from oobleck_hpc.errors import OobleckError
    from oobleck_hpc.story import Tail

    t0 = time.time()
    run_dir = Path(args.run_dir)
    try:
        if args.run_dir.isdigit() and not run_dir.exists():
            from oobleck_hpc.launch.slurm import run_dir_of_job

            run_dir = run_dir_of_job(args.run_dir)
        roster = run_dir / "roster.json"
        if not roster.exists():
            raise ValueError(f"no job is running in {run_dir} ({roster} is missing); give the "
                             "run directory of a running job, or its Slurm job id")
        check_running(run_dir)
        request_drain(run_dir, args.nodes, args.force, known=Roster.load(roster).names)
    except (OobleckError, OSError, ValueError) as e:
        print(f"oobleck-hpc drain: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"asked {', '.join(args.nodes)} of the job in {run_dir} to drain: "
          f"{'they leave' if len(args.nodes) > 1 else 'it leaves'} at the next step boundary "
          "(events drain_agreed / drain_refused)")
    deadline = time.monotonic() + args.wait
    events = Tail(run_dir / "events.jsonl")
    waiting = set(args.nodes)
    while waiting and time.monotonic() < deadline:
        if (why := not_running(run_dir)) is not None:
            print(f"oobleck-hpc drain: {why}", file=sys.stderr)
            return EXIT_BAD_INPUT
        for e in events.read():
            if e["t"] >= t0 and e.get("kind") in ("drain_agreed", "drain_refused"):
                mine = waiting & set(e.get("nodes", []))
                if mine and e["kind"] == "drain_agreed":
                    print(f"{', '.join(sorted(mine))} left after step {e['step']}")
                elif mine:
                    print(f"drain of {', '.join(sorted(mine))} refused: {e['reason']}"
                          + (" -- the job stops with a checkpoint and is requeued without "
                             "them" if e.get("force") else "; --force stops the job with a "
                             "checkpoint and requeues it without them"))
                waiting -= mine
        time.sleep(0.2)
    if waiting and args.wait > 0:
        print(f"no verdict for {', '.join(sorted(waiting))} within {args.wait:.0f} s (see "
              f"{run_dir / 'events.jsonl'})", file=sys.stderr)
        return EXIT_UNCONFIRMED
    return 0


def _grow(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from oobleck_hpc.elastic.wire import Roster
    from oobleck_hpc.errors import OobleckError
    from oobleck_hpc.story import Tail

    run_dir = Path(args.run_dir)
    t0 = time.time()
    if args.nodes < 1:
        print(f"oobleck-hpc grow: error: --nodes {args.nodes}: grow by at least one node",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.run_dir.isdigit() and not run_dir.exists():
            from oobleck_hpc.launch.slurm import run_dir_of_job

            run_dir = run_dir_of_job(args.run_dir)
        roster = run_dir / "roster.json"
        check_running(run_dir)
        before = set(Roster.load(roster).names) if roster.exists() else set()
        if (run_dir / "discovery.json").exists() and not (run_dir / "agents.json").exists():
            from oobleck_hpc.config import load_job
            from oobleck_hpc.launch.slurm import submit_replacement

            job = load_job(args.job or run_dir / "job.yaml")
            job_id = submit_replacement(job, run_dir, args.nodes, args.reason)
            print(f"submitted replacement job {job_id} ({args.nodes} node(s)) for the job in "
                  f"{run_dir}: once it starts, its agents join like spares; it ends with the job")
        else:
            from oobleck_hpc.launch.local import grow

            names = grow(run_dir, args.nodes)
            print(f"started {', '.join(names)} for the job in {run_dir}: each joins while the "
                  "job runs on fewer nodes than it started with, else waits as a spare for the "
                  "next loss")
    except (OobleckError, OSError, ValueError, TimeoutError, RuntimeError) as e:
        print(f"oobleck-hpc grow: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    deadline = time.monotonic() + args.wait
    joined: set[str] = set()
    events = Tail(run_dir / "events.jsonl")  # each poll reads only what was appended
    while len(joined) < args.nodes and time.monotonic() < deadline:
        if (why := not_running(run_dir)) is not None:
            print(f"{len(joined)} of {args.nodes} node(s) joined: {why} (a grown node joins "
                  "while the job runs on fewer nodes than it started with, else it waits as a "
                  "spare for the next loss)", file=sys.stderr)
            return EXIT_UNCONFIRMED
        for e in events.read():
            if (e.get("kind") == "node_joined" and e.get("node") not in before | joined
                    and e["t"] >= t0):
                print(f"{e['node']} joined: generation {e['generation']}, from step {e['step']}, "
                      f"{e['seconds']:.2f} s after the agreement")
                joined.add(e["node"])
        time.sleep(0.2)
    if len(joined) < args.nodes and args.wait > 0:
        print(f"{len(joined)} of {args.nodes} node(s) joined within {args.wait:.0f} s (see "
              f"{run_dir / 'events.jsonl'})", file=sys.stderr)
        return EXIT_UNCONFIRMED
    return 0


def not_running(run_dir) -> str | None:
    """Why the job in RUN_DIR is not running ("the job in RUN_DIR is not running (ended at
    step S: finished|failed)"), or None while it runs: a local job while `oobleck-hpc run`
    holds RUN_DIR/job.lock or, started without it, while an agent of RUN_DIR/agents.json lives
    and no exit.json is written; a Slurm job (RUN_DIR's run `slurm-ID`) while Slurm has it
    pending or running."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from oobleck_hpc import runs
    from oobleck_hpc.launch.watch import EXIT_RECORD, SLURM_ALIVE, lock_holder

    run_dir = Path(run_dir)
    run = runs.read_run_id(run_dir)
    if run.startswith("slurm-"):
        out = subprocess.run(["squeue", "-h", "-j", run.removeprefix("slurm-"), "-o", "%T"],
                             capture_output=True, text=True, timeout=60)
        if out.stdout.strip() in SLURM_ALIVE:
            return None
    elif lock_holder(run_dir / "job.lock") is not None:
        return None
    elif not (run_dir / EXIT_RECORD).exists():
        try:
            pids = json.loads((run_dir / "agents.json").read_text()).values()
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(int(pid), 0)
                return None
            except (OSError, ValueError):
                continue
    out = runs.outcome(run_dir)
    return (f"the job in {run_dir} is not running (ended at step {out.last_step}: "
            f"{'finished' if out.finished else 'failed'})")


def check_running(run_dir) -> None:
    """Raise ValueError (the commands' exit 2) when the job in RUN_DIR is not running."""
    why = not_running(run_dir)
    if why is not None:
        raise ValueError(why)


def _run(args: argparse.Namespace) -> int:
    import os
    import sys

    from oobleck_hpc import runs
    from oobleck_hpc.config import load_job
    from oobleck_hpc.launch.watch import JobLock, write_run_record

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
    check_local_inputs(job)
    if args.max_requeues < 0:
        raise ConfigError("<command line>", "--max-requeues", f"value {args.max_requeues} is "
                          "negative", "use 0 to never requeue")
    # Everything of the run -- its records, the agents', the workers' -- is the user's alone, or
    # also the group's to read (the job's group_access: runs.py, "Private").
    run_dir = runs.make_run_dir(job.resolved_run_dir, job.group_access)
    with runs.private_files(job.group_access), JobLock(run_dir):
        begin_run(run_dir, job.group_access)
        runs.write_job(run_dir, job, "run")
        write_run_record(run_dir, [sys.executable, "-m", "oobleck_hpc", *sys.argv[1:]],
                         cwd=os.getcwd(), checkpoint_dir=job.checkpoint.dir)
        code = EXIT_UNRECOVERABLE
        try:
            code = _launch_with_requeue(args, job, overrides, run_dir)
        finally:
            end_run(run_dir, code, args.metrics)
        return code


def end_run(run_dir, code: int, metrics=None) -> None:
    """Record how the run ended: RUN_DIR/exit.json (what `watch` reads) and a `run_ended` event
    (the console tells a run that did not finish), both with the run's verdict
    (oobleck_hpc/runs.py: finished only when its last step is committed)."""
    from oobleck_hpc import runs
    from oobleck_hpc.elastic.events import EventLog
    from oobleck_hpc.launch.watch import record_exit
    from oobleck_hpc.story import Story

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

    from oobleck_hpc import runs

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


def _launch_with_requeue(args: argparse.Namespace, job, overrides: dict, run_dir) -> int:
    import json
    import tempfile
    from pathlib import Path

    import yaml

    from oobleck_hpc.config import load_job
    from oobleck_hpc.elastic.events import EventLog
    from oobleck_hpc.launch.local import Console, launch_local
    from oobleck_hpc.launch.requeue import run_with_requeue

    metrics = Path(args.metrics or run_dir / "metrics.jsonl")
    if args.metrics:  # outside the run directory: this run's steps only
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text("")
    events = EventLog(run_dir / "events.jsonl", source="launcher")
    events.emit("run_started", job=job.name, model=job.model.name, steps=job.train.steps,
                nodes=job.cluster.nodes, gpus_per_node=job.cluster.gpus_per_node,
                launch="local")
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
        return launch_local(this, job_path, metrics=metrics, run_dir=run_dir, console=console)

    from oobleck_hpc.launch.slurm import min_nodes

    code, _ = run_with_requeue(launch, nodes=job.cluster.nodes, run_dir=run_dir,
                               max_requeues=args.max_requeues, min_nodes=min_nodes(job),
                               events=events)
    console.poll()
    return code
