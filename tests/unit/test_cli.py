"""The `oobleck-hpc` command table (oobleck_hpc/cli.py): each command imports only its own
module, so the table must name every command its modules register, and the right module."""

from __future__ import annotations

import argparse

from oobleck_hpc import cli
from oobleck_hpc.errors import EXIT_BAD_INPUT, EXIT_UNCONFIRMED


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_the_command_table_names_every_command_with_the_module_that_registers_it():
    assert _commands(cli.build_parser()) == set(cli.COMMANDS)
    for command, module in cli.COMMANDS.items():
        assert command in _commands(cli.build_parser(command)), (command, module)


def test_grow_answers_a_job_that_ended_at_once_and_returns_when_it_ends_while_waiting(
        tmp_path, monkeypatch, capsys):
    """`oobleck-hpc grow RUN_DIR --wait S` (issue 27): while the job runs (its `oobleck-hpc run`
    holds RUN_DIR/job.lock) it waits; a job that ends while it waits ends the wait then, not
    after S seconds (this test would take 60 s); a job that ended already is refused at once
    (exit 2), naming the step it ended at and whether it finished."""
    import json
    import threading
    import time

    from oobleck_hpc.launch import local
    from oobleck_hpc.operate.liveness import JobLock, record_exit

    monkeypatch.setattr(local, "grow", lambda run_dir, count: ["node5"])  # the launcher's answer
    run_dir = tmp_path / "run"
    with JobLock(run_dir):  # running: no node_joined event within --wait
        assert cli.main(["grow", str(run_dir), "--nodes", "1", "--wait", "0.5"]) == EXIT_UNCONFIRMED
    assert capsys.readouterr().err.splitlines()[-1].startswith("0 of 1 node(s) joined within")

    def finish_in(seconds: float, lock: JobLock, started: threading.Event) -> None:
        with lock:
            started.set()
            time.sleep(seconds)
            (run_dir / "events.jsonl").write_text(json.dumps(
                {"t": time.time(), "kind": "run_finished", "steps": 3, "total": 3}) + "\n")
            record_exit(run_dir, 0, "finished")

    started = threading.Event()
    job = threading.Thread(target=finish_in, args=(1.0, JobLock(run_dir), started))
    job.start()
    started.wait(10)
    t0 = time.monotonic()
    assert cli.main(["grow", str(run_dir), "--nodes", "1", "--wait", "60"]) == EXIT_UNCONFIRMED
    job.join()
    assert time.monotonic() - t0 < 30
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"0 of 1 node(s) joined: the job in {run_dir} is not running (ended at step 3: "
        "finished)")
    assert cli.main(["grow", str(run_dir), "--nodes", "1", "--wait", "60"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"oobleck-hpc grow: error: the job in {run_dir} is not running (ended at step 3: "
        "finished)")


def test_an_agent_whose_port_is_busy_exits_for_a_requeue_and_a_bad_path_as_bad_input(
        monkeypatch, capsys):
    """A port another process holds (EADDRINUSE) is this node's passing trouble, not a wrong job
    file: the agent exits 75 (requeue); any other OSError stays 2 (bad input), on stderr."""
    import socket

    from oobleck_hpc.control import agent
    from oobleck_hpc.errors import EXIT_REQUEUE

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()

    class BusyPort:
        def __init__(self, opts):
            pass

        def run(self) -> int:
            with socket.socket() as s:
                s.bind(held.getsockname())
            return 0

    class MissingFile(BusyPort):
        def run(self) -> int:
            open("/nonexistent/oobleck-roster.json")
            return 0

    monkeypatch.setattr(agent, "parse_args", lambda argv: None)
    with held:
        monkeypatch.setattr(agent, "Agent", BusyPort)
        assert agent.main([]) == EXIT_REQUEUE
        assert "Address already in use" in capsys.readouterr().err
    monkeypatch.setattr(agent, "Agent", MissingFile)
    assert agent.main([]) == EXIT_BAD_INPUT
    assert "oobleck-roster.json" in capsys.readouterr().err


def test_log_level_goes_before_the_command_and_reaches_the_processes_it_starts(
        monkeypatch, capsys):
    """`oobleck-hpc --log-level DEBUG plan ...` logs at DEBUG and exports the level
    (OOBLECK_LOG_LEVEL) to the agents and workers the launchers start; without it, WARNING,
    and the command's own output on stdout is the same but for its timings."""
    import logging
    import os
    from pathlib import Path

    from oobleck_hpc.diagnostics import LOG_LEVEL_ENV

    job = str(Path(__file__).parents[2] / "examples" / "gpt-tiny-local.yaml")
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    outs = []
    for argv, level in ((["plan", job], logging.WARNING),
                        (["--log-level", "DEBUG", "plan", job], logging.DEBUG)):
        monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
        monkeypatch.setattr(root, "handlers", [])  # (basicConfig acts on a root without any)
        assert cli.main(argv) == 0
        assert root.level == level
        outs.append([line for line in capsys.readouterr().out.splitlines()
                     if not line.startswith("took ")])  # (its timings vary)
    assert os.environ[LOG_LEVEL_ENV] == "DEBUG" and outs[0] == outs[1] != []
