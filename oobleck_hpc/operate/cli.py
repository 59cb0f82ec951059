"""The commands that act on a running job, from another shell (each exits 0, or 2 on bad input;
drain and grow exit 1 when --wait ends without the verdict):

`oobleck-hpc kill-node RUN_DIR NODE`: kill a node of a running local job (kill.py);
`oobleck-hpc drain RUN_DIR|JOB_ID NODE...`: a node leaves a running job at a step boundary
(control/drain.py);
`oobleck-hpc grow RUN_DIR|JOB_ID --nodes K`: add K nodes to a running job (they join in place;
under Slurm through a replacement job);
`oobleck-hpc watch JOB_ID_OR_RUN_DIR`: restart a job that died or hung, from its latest
checkpoint (watch.py).

Light to import (no torch): kill-node must act at once on a machine the job keeps busy.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_UNCONFIRMED


def register(sub: argparse._SubParsersAction) -> None:
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
                       "without it (control/drain.py). Under Slurm an administrator's `scontrol "
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

    p = sub.add_parser(
        "watch", help="restart a job that died without requeue or stopped making progress",
        description=__doc__.splitlines()[0])
    p.add_argument("target", metavar="JOB_ID_OR_RUN_DIR",
                   help="the job's run dir (runs/<name>, holds run.json) or a Slurm job id")
    p.add_argument("--interval", type=float, default=30.0, metavar="S",
                   help="seconds between checks (default 30)")
    p.add_argument("--stall-minutes", type=float, default=30.0, metavar="M",
                   help="a live job whose heartbeat step has not advanced for M minutes is "
                        "stopped and restarted (default 30; needs a run dir)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping a hung job (default 30)")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="give up after N restarts (default 10)")
    p.add_argument("--once", action="store_true", help="check and act once, then exit")
    p.set_defaults(func=_watch)


def _private(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command`, creating files for the user alone (runs.private_files): the drain and grow
    requests, a replacement job's submitit files. (`run` takes the job's group_access.)"""
    def run(args: argparse.Namespace) -> int:
        from oobleck_hpc.records import runs

        with runs.private_files():
            return command(args)

    return run


def _kill_node(args: argparse.Namespace) -> int:
    import signal

    from oobleck_hpc.operate.kill import kill_node  # (only these: it acts at once)
    from oobleck_hpc.records.story import KILLED

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

    from oobleck_hpc.control.drain import request_drain
    from oobleck_hpc.control.wire import Roster
    from oobleck_hpc.errors import OobleckError
    from oobleck_hpc.records.story import Tail

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

    from oobleck_hpc.control.wire import Roster
    from oobleck_hpc.errors import OobleckError
    from oobleck_hpc.records.story import Tail

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

    from oobleck_hpc.records import runs
    from oobleck_hpc.operate.liveness import EXIT_RECORD, lock_holder
    from oobleck_hpc.operate.watch import SLURM_ALIVE

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


def _watch(args: argparse.Namespace) -> int:
    from oobleck_hpc.operate.watch import watchdog_for

    dog = watchdog_for(args.target, interval_s=args.interval, stall_s=60.0 * args.stall_minutes,
                       grace_s=args.grace, max_restarts=args.max_restarts)
    return dog.loop(once=args.once)
