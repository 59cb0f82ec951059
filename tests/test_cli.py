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


def test_grow_wait_returns_once_the_local_job_ended(tmp_path, monkeypatch, capsys):
    """`oobleck-hpc grow RUN_DIR --wait S` (issue 27): a node grown into a job that has all its
    nodes waits as a spare; when the job ends first, the command says so and returns then,
    not after S seconds (without that, this test fails after 60 s). While the job runs (its `oobleck-hpc run` holds RUN_DIR/job.lock) it
    waits."""
    from oobleck_hpc.launch import local
    from oobleck_hpc.launch.watch import JobLock, record_exit

    monkeypatch.setattr(local, "grow", lambda run_dir, count: ["node5"])  # the launcher's answer
    run_dir = tmp_path / "run"
    with JobLock(run_dir):  # running: no node_joined event within --wait
        assert cli.main(["grow", str(run_dir), "--nodes", "1", "--wait", "0.5"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 of 1 node(s) joined within")

    record_exit(run_dir, 0, "finished")  # ended (the lock released after the record)
    assert cli.main(["grow", str(run_dir), "--nodes", "1", "--wait", "60"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"0 of 1 node(s) joined: the job in {run_dir} ended (exit 0: finished) before")
