"""Node agents as local processes: N pretend nodes on this machine, each an agent process group.

What the local launcher, the tests and the benchmarks need to run the control plane for real:

    agents = LocalAgents.start(run_dir, nodes=4, workers=2, job="job.yaml")   # worker: train.py
    agents.kill("node2")                    # a node failure: its agent and workers at once
    agents.signal("node1", signal.SIGSTOP)  # a hang (returns once the agent is really stopped)
    agents.add(1)                           # grow: node4 joins the running job (like a spare)
    codes = agents.wait(timeout=600)        # node -> exit code
    agents.cleanup()                        # kill whatever is left (idempotent)

Each agent runs `python -m oobleck_hpc.control.agent` in its own session (process group), so a node
failure is one `killpg`: the agent and its workers vanish together, as when a machine dies. The
roster (nodes on 127.0.0.1, free ports, generation 0's store port) is written to
RUN_DIR/roster.json, the run's secret to RUN_DIR/secret (kept if the launcher wrote it:
auth.py), handed to the agents in $OOBLECK_SECRET_FILE; agent output goes to
RUN_DIR/logs/agent-<node>.log; events to RUN_DIR/events.jsonl. All of it, and what the agents and their workers write, is the user's
alone (0700 / 0600; `group_access`: the group may read it too: records/runs.py, "Private").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from oobleck_hpc.config import FENCED_GRACE_S, STARTUP_S
from oobleck_hpc.records import runs
from oobleck_hpc.control.auth import SECRET_ENV, write_secret
from oobleck_hpc.control.wire import NodeAddress, Roster, free_ports
from oobleck_hpc.control.workers import process_state
from oobleck_hpc.polling import wait_until


@dataclass
class LocalAgents:
    run_dir: Path
    roster: Roster
    workers: int
    """Worker processes per node."""
    procs: dict[str, subprocess.Popen[bytes]]
    logs: list[IO[str]] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    """The agent command line before --node (and the worker command after it: `tail`)."""
    tail: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    console: bool = False
    group_access: bool = False
    """The files of the run are its user's alone, or also its group's to read (records/runs.py)."""

    @classmethod
    def start(cls, run_dir: str | Path, nodes: int | Sequence[str], workers: int = 1, *,
              command: Sequence[str] | None = None, job: str | Path | None = None,
              heartbeat_s: float | None = None, lease_s: float | None = None,
              quorum: str = "majority", startup_s: float = STARTUP_S,
              kill_grace_s: float = FENCED_GRACE_S,
              extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
              console: bool = False, spares: int = 0,
              group_access: bool = False) -> LocalAgents:
        """Start one agent per node. `command` is the worker command (default, with `job`:
        python -m oobleck_hpc.train). Timing flags left None come from the job file (or the
        agent's defaults). console=True: the agents' (and so the workers') stdout stays this
        process's stdout (rank 0's plan, progress and summary); stderr still goes to the logs.
        `spares`: that many more agents, outside generation 0, swapped in after a loss.
        `group_access`: the job's (records/runs.py, "Private"); they start with its umask."""
        run_dir = Path(run_dir)
        with runs.private_files(group_access):  # (RUN_DIR's files: records/runs.py, "Private")
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            names = [f"node{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
            names += [f"node{i}" for i in range(len(names), len(names) + spares)]
            *ports, store_port = free_ports(len(names) + 1)
            roster = Roster(tuple(NodeAddress(m, "127.0.0.1", p) for m, p in zip(names, ports)),
                            store_port, spares)
            roster.write(run_dir / "roster.json")
            secret = write_secret(run_dir, fresh=False)  # (the launcher's, if it began the run)
            argv = [sys.executable, "-m", "oobleck_hpc.control.agent",
                    "--roster", str(run_dir / "roster.json"), "--run-dir", str(run_dir),
                    "--workers", str(workers), "--quorum", quorum,
                    "--startup-s", str(startup_s), "--kill-grace-s", str(kill_grace_s)]
            if job is not None:
                argv += ["--job", str(job)]
            if heartbeat_s is not None:
                argv += ["--heartbeat-s", str(heartbeat_s)]
            if lease_s is not None:
                argv += ["--lease-s", str(lease_s)]
            argv += list(extra_args)
            tail = ["--", *command] if command else []
            agents = cls(run_dir, roster, workers, {}, argv=argv, tail=tail,
                         env={**os.environ, SECRET_ENV: str(secret), **(env or {})},
                         console=console, group_access=group_access)
            try:
                for m in names:
                    agents._spawn(m)
            except BaseException:
                agents.cleanup()
                raise
            return agents

    def _spawn(self, node: str, *flags: str) -> None:
        fd = os.open(self.run_dir / "logs" / f"agent-{node}.log",
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)  # (& ~umask: records/runs.py)
        log = open(fd, "w")
        self.logs.append(log)
        self.procs[node] = subprocess.Popen(
            [*self.argv, *flags, "--node", node, *self.tail], stdout=None if self.console else log,
            stderr=log if self.console else subprocess.STDOUT, env=self.env,
            start_new_session=True, umask=runs.umask(self.group_access))

    def add(self, count: int, on: list[str] | None = None) -> list[str]:
        """Grow the running job: `count` new nodes (named `on`, else after the last one),
        appended to the roster file as spares, each with its agent. They ask to join once their workers are
        ready (`--boost-start`: the workers, which share the cores with the members', start at
        a higher priority) and are added by the members at a step boundary while the view is
        smaller than the job (membership.py, step 7); the members learn their addresses from
        their first message. Returns their names."""
        if count < 1:
            raise ValueError(f"count={count}: grow by at least one node")
        used = {int(n[4:]) for n in self.names if n.startswith("node") and n[4:].isdigit()}
        start = max(used, default=-1) + 1
        new = list(on) if on else [f"node{i}" for i in range(start, start + count)]
        if len(new) != count or set(new) & set(self.names) or len(set(new)) != count:
            raise ValueError(f"grow by {count} nodes named {new}: the names must be "
                             f"{count} new ones (the job has {self.names})")
        for name, port in zip(new, free_ports(count)):
            self.roster = self.roster.with_node(NodeAddress(name, "127.0.0.1", port))
        with runs.private_files(self.group_access):
            self.roster.write(self.run_dir / "roster.json")  # atomically, before any agent reads it
            for name in new:
                self._spawn(name, "--boost-start")
        return new

    @property
    def names(self) -> list[str]:
        return list(self.roster.names)

    def signal(self, node: str, sig: int) -> float:
        """Send `sig` to the node's whole process group; returns the time.time() it was sent.
        For SIGSTOP, returns only once the agent is really stopped (kill() does not wait)."""
        t = time.time()
        pid = self.procs[node].pid
        os.killpg(pid, sig)
        if sig == signal.SIGSTOP:
            try:
                wait_until(lambda: process_state(pid) in ("T", "t"), 5.0, f"{node} to stop",
                           every_s=0.001)
            except TimeoutError:
                pass  # (a process in uninterruptible sleep stops later; the caller goes on)
        return t

    def kill(self, node: str) -> float:
        """A node failure: SIGKILL to its agent and workers at once."""
        return self.signal(node, signal.SIGKILL)

    def poll(self) -> dict[str, int | None]:
        return {m: p.poll() for m, p in self.procs.items()}

    def forward(self, signum: int) -> None:
        """A stop signal the launcher got, to every agent still running (they forward it to
        their workers)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float, nodes: Sequence[str] | None = None) -> dict[str, int]:
        """Exit codes of `nodes` (default all); raises TimeoutError naming those still running."""
        deadline = time.monotonic() + timeout
        codes = {}
        for m in nodes or self.names:
            try:
                codes[m] = self.procs[m].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [n for n in (nodes or self.names) if self.procs[n].poll() is None]
                raise TimeoutError(f"agents {running} still run after {timeout} s "
                                   f"(logs: {self.run_dir / 'logs'})") from None
        return codes

    def cleanup(self) -> None:
        """Kill every agent group still running (resuming stopped ones first); close logs."""
        for p in self.procs.values():
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for log in self.logs:
            log.close()
        self.logs.clear()
