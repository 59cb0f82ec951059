"""`oobleck-hpc` command line: one subcommand per stage of a job's life.

Each command lives beside the code it drives and registers itself through `register(subparsers)`;
the modules listed here import nothing heavy at import time, so `oobleck-hpc plan` stays fast.
Errors of this package (bad YAML, bad profile, impossible plan) print one clear message and exit
with the code documented in oobleck_hpc/errors.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from oobleck_hpc.errors import OobleckError

COMMAND_MODULES = [
    "oobleck_hpc.planning.cli",  # plan
    "oobleck_hpc.profiling.cli",  # profile, profiles
    "oobleck_hpc.sim.cli",  # simulate
    "oobleck_hpc.launch.cli_watch",  # watch
    "oobleck_hpc.launch.cli_slurm",  # submit
    "oobleck_hpc.launch.cli",  # run
    "oobleck_hpc.chaos",  # chaos
    "oobleck_hpc.report",  # report
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oobleck-hpc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OobleckError as e:
        print(f"oobleck-hpc {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":  # `python -m oobleck_hpc.cli` as well as `python -m oobleck_hpc`
    raise SystemExit(main())
