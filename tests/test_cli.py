"""The `oobleck-hpc` command table (oobleck_hpc/cli.py): each command imports only its own
module, so the table must name every command its modules register, and the right module."""

from __future__ import annotations

import argparse

from oobleck_hpc import cli


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_the_command_table_names_every_command_with_the_module_that_registers_it():
    assert _commands(cli.build_parser()) == set(cli.COMMANDS)
    for command, module in cli.COMMANDS.items():
        assert command in _commands(cli.build_parser(command)), (command, module)
