"""`oobleck-hpc fleet run FLEET.yaml [--run-dir DIR]`: every job of a fleet on this machine, and
the fleet manager that moves nodes between them (issue 32, local).

Each job is an ordinary local job: `oobleck-hpc run JOB.yaml --run-dir DIR/<job> --nodes K
--max-requeues 0` (launch/cli.py, launch/local.py), its own process session, K its share of the
pool from the fleet's decision (allocate.decide on every job's WAF curve, curves.py). The
manager runs in this process: it reads what each job appends to its events (records/story.Tail),
keeps each job's node count, and acts through the jobs' public operations only -- a drain
request (control/drain.request_drain) and a grow (launch/local.grow) -- as fleet/manager.py
decides. Its decisions, moves and each job's node count over time are the fleet's own
DIR/events.jsonl (`fleet_*` events: `oobleck-hpc fleet status DIR` tells them).

The fleet is over when every job's launcher exited; exit code 0 when every job finished, else
the first job's nonzero code. Ctrl-C / SIGTERM: forwarded to every job's launcher (which
checkpoint and stop), then whatever is left after a grace period is killed, by pid.
Not built: a Slurm fleet (`fleet submit`), a manager restarted from its records, a job stopped
or requeued inside the fleet.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.fleet import cli as fleet_cli
from oobleck_hpc.fleet.manager import Action, Drain, Grow, JobState, Manager, Start
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.records.story import Tail

POLL_S = 0.2
STOP_GRACE_S = 30.0
"""Seconds the jobs get to stop after a forwarded signal before they are killed."""


@dataclass
class FleetJobRun:
    """One job of the fleet on this machine: its launcher process and its events."""

    name: str
    job_file: Path
    run_dir: Path
    proc: subprocess.Popen | None = None
    tail: Tail | None = None
    log: IO[bytes] | None = None

    def start(self, nodes: int) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "oobleck_hpc", "run", str(self.job_file), "--run-dir",
               str(self.run_dir), "--nodes", str(nodes), "--max-requeues", "0"]
        self.log = open(self.run_dir.parent / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.tail = Tail(self.run_dir / "events.jsonl")
        return self.proc.pid

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the launcher forwards it and checkpoints), then SIGKILL what is left."""
        from oobleck_hpc.operate.chaos import kill_leftovers

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        kill_leftovers(self.proc, self.run_dir)
        if self.log is not None:
            self.log.close()


@dataclass
class FleetRun:
    path: Path
    run_dir: Path
    jobs: dict[str, FleetJobRun] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    _stop: bool = False

    def run(self) -> int:
        from oobleck_hpc.fleet.config import load_fleet
        from oobleck_hpc.fleet.curves import job_curve

        fleet, entries = load_fleet(self.path)
        events = self.run_dir / "events.jsonl"
        if events.exists():
            raise ConfigError("<command line>", "--run-dir", f"value {str(self.run_dir)!r} "
                              "holds a fleet run already", "give the fleet a new --run-dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = EventLog(events, source="fleet")
        states = []
        for fj in entries:
            c = job_curve(fj, fleet.pool.nodes)
            states.append(JobState(fj.name, c.waf, fj.entry.min_nodes, fj.entry.max_nodes,
                                   fj.entry.transition_s))
            self.jobs[fj.name] = FleetJobRun(fj.name, fleet.job_path(fj.entry).resolve(),
                                             self.run_dir / fj.name)
        manager = Manager(states, fleet.pool.nodes, fleet.mtbf_hours * 3600, log.emit)
        t0 = time.monotonic()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            first = manager.start()
            log.emit("fleet_started", fleet=fleet.name, pool=fleet.pool.nodes,
                     nodes=manager.counts(), waf=manager.waf_now(),
                     run_dirs={n: str(j.run_dir) for n, j in self.jobs.items()})
            self._enact(manager, first, log)
            self._loop(manager, log)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for job in self.jobs.values():
                job.stop(STOP_GRACE_S if self._stop else 5.0)
            log.emit("fleet_ended", codes=self.codes, seconds=round(time.monotonic() - t0, 3))
            log.close()
        bad = [c for c in self.codes.values() if c != 0]
        if bad:
            return bad[0]
        return 0 if len(self.codes) == len(self.jobs) else 3  # (a job never got nodes)

    def _on_signal(self, signum, _frame) -> None:
        self._stop = True
        for job in self.jobs.values():
            if job.proc is not None and job.proc.poll() is None:
                job.proc.send_signal(signum)

    def _loop(self, manager: Manager, log: EventLog) -> None:
        while True:
            started = [j for j in self.jobs.values() if j.proc is not None]
            if all(j.name in self.codes for j in started):
                return  # every started job ended, and the last end started none
            for job in started:
                if job.name in self.codes:
                    continue
                assert job.tail is not None and job.proc is not None
                for e in job.tail.read():
                    self._enact(manager, manager.on_event(job.name, e), log)
                code = job.proc.poll()
                if code is not None:
                    for e in job.tail.read():  # its last events first
                        self._enact(manager, manager.on_event(job.name, e), log)
                    self.codes[job.name] = code
                    self._enact(manager, manager.on_exit(job.name, code, code == 0), log)
            time.sleep(POLL_S)

    def _enact(self, manager: Manager, actions: list[Action], log: EventLog) -> None:
        from oobleck_hpc.control.drain import request_drain
        from oobleck_hpc.launch.local import grow

        if self._stop:  # (stopping: nothing starts, nothing moves)
            return
        for a in actions:
            job = self.jobs[a.job]
            if isinstance(a, Start):
                pid = job.start(a.count)
                log.emit("fleet_job_started", job=a.job, nodes=a.count,
                         run_dir=str(job.run_dir), pid=pid)
            elif isinstance(a, Drain):
                request_drain(job.run_dir, [a.node], by="fleet")
            elif isinstance(a, Grow):
                try:
                    names = grow(job.run_dir, a.count)
                except (OSError, RuntimeError, TimeoutError) as e:
                    log.emit("fleet_move_failed", job=a.job, reason=f"grow: {e}")
                    continue
                log.emit("fleet_grow", job=a.job, nodes=names, from_job=a.from_job)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is None:
        from oobleck_hpc.fleet.config import load_fleet

        fleet, _ = load_fleet(args.fleet)
        run_dir = Path("runs") / fleet.name
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return FleetRun(Path(args.fleet), run_dir).run()


def register(sub: argparse._SubParsersAction) -> None:
    """`fleet plan` and `fleet status` (fleet/cli.py), and `fleet run` (here: it starts jobs)."""
    fleet_sub = fleet_cli.register(sub)
    p = fleet_sub.add_parser("run", help="run every job of the fleet on this machine, and the "
                             "manager that moves nodes between them")
    p.add_argument("fleet", help="YAML fleet file")
    p.add_argument("--run-dir", default=None,
                   help="the fleet's run dir: its events, and each job's run dir under it "
                        "(default: runs/<fleet name>)")
    p.set_defaults(func=run)
