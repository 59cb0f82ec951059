"""`oobleck-hpc watch JOB_ID_OR_RUN_DIR`: restart a job that died or hung, from its latest checkpoint.

See oobleck_hpc/launch/watch.py for what is observed and decided. Light to import (no torch).
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from oobleck_hpc.launch.watch import watchdog_for

    dog = watchdog_for(args.target, interval_s=args.interval, stall_s=60.0 * args.stall_minutes,
                       grace_s=args.grace, max_restarts=args.max_restarts)
    return dog.loop(once=args.once)
