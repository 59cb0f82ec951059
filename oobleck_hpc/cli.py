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

from oobleck_hpc.diagnostics import LEVELS, configure
from oobleck_hpc.errors import OobleckError

COMMANDS = {
    "plan": "oobleck_hpc.planning.cli",
    "profile": "oobleck_hpc.profiling.cli", "profiles": "oobleck_hpc.profiling.cli",
    "simulate": "oobleck_hpc.sim.cli", "fleet": "oobleck_hpc.launch.fleet",
    "submit": "oobleck_hpc.launch.cli_slurm", "run": "oobleck_hpc.launch.cli",
    "kill-node": "oobleck_hpc.operate.cli", "drain": "oobleck_hpc.operate.cli",
    "grow": "oobleck_hpc.operate.cli", "watch": "oobleck_hpc.operate.cli",
    "chaos": "oobleck_hpc.operate.chaos",
    "report": "oobleck_hpc.records.report",
    "export": "oobleck_hpc.checkpoint.export",
}
"""Each command and the module that registers it (and runs it). A command given on the command
line imports its own module only: `kill-node` must act at once, also on a machine whose cores
the job's workers keep busy, where each module imported costs ten times its CPU time."""
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of `command`'s module when it is a known one."""
    parser = argparse.ArgumentParser(prog="oobleck-hpc", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", choices=LEVELS, default=None,
                        help="how much diagnostics to log on stderr, here and in the agents and "
                        "workers this command starts (default WARNING; agents INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in [COMMANDS[command]] if command in COMMANDS else COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)  # (after --log-level LEVEL)
    args = build_parser(command).parse_args(argv)
    configure("WARNING", args.log_level)
    try:
        return int(args.func(args) or 0)
    except OobleckError as e:
        print(f"oobleck-hpc {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":  # `python -m oobleck_hpc.cli ...`, as `python -m oobleck_hpc ...`
    raise SystemExit(main())
