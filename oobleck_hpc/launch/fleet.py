"""`oobleck-hpc fleet run FLEET.yaml [--run-dir DIR] [--resume]`: every job of a fleet on this
machine, and the fleet manager that moves nodes between them (issue 32, local).

Each job is an ordinary local job: `oobleck-hpc run JOB.yaml --run-dir DIR/<job> --nodes K
--max-requeues 0` (launch/cli.py, launch/local.py), its own process session, K its share of the
pool from the fleet's decision (allocate.decide on every job's WAF curve, curves.py). The
manager runs in this process: it reads what each job appends to its events (records/story.Tail),
keeps each job's node count, and acts through the jobs' public operations only -- a drain
request (control/drain.request_drain) and a grow (launch/local.grow) -- as fleet/manager.py
decides. Its decisions, moves and each job's node count over time are the fleet's own
DIR/events.jsonl (`fleet_*` events: `oobleck-hpc fleet status DIR` tells them).

The manager's records: DIR/manager.json, rewritten atomically whenever an event changed
something -- the manager's state (`Manager.snapshot`), how far it read each job's events, each
job launcher's pid, the actions decided and not yet done, the fleet events not yet written. In
that order: the state with the actions is written first, then the events, then the actions are
done, then the state without them. So the manager can die at any point (SIGKILL) and the jobs
train on (their own sessions); `fleet run FLEET --run-dir DIR --resume` takes the fleet over:
it writes what the dead manager had decided but not written, does the actions it had not done
(each can be done twice: a drain request is a file per node, a grow is tagged with the
action's number and answered once per tag, a job's attempt is started only if its events hold
no `run_started` of it, which names its launcher's pid), reads each job's events from where it
stopped, and watches the launchers it did not start by pid and by their `run_ended` event.
Only re-allocation pauses while no manager runs.

A job that falls back to its checkpoint (its launcher exits 75; or stopped by a SIGTERM to its
launcher when it ran below its min_nodes) waits in the fleet and is started again, from its
checkpoint, when the manager gives it nodes (fleet/manager.py).

The fleet is over when every job's launcher exited and none was started again; exit code 0
when every job finished, else the first job's nonzero code (75: a job still waits).
Ctrl-C / SIGTERM: forwarded to every job's launcher (which checkpoint and stop), then
whatever is left after a grace period is killed, by pid.
In a Slurm allocation (`fleet run --slurm`, what `oobleck-hpc fleet submit` runs in the batch
script of the fleet's allocation) each job's launcher runs here, on the batch node, with
`--on-nodes`: its agents are one-node steps on the nodes the manager gave it
(launch/slurm_steps.py); which job holds which node is the manager's too, in its records
(launch/fleet_pool.py). The batch node runs every job's launcher: losing it ends the fleet's
jobs (each resumes from its checkpoint in a new fleet).
Not built: stopping a job of a running fleet by hand; requeueing a Slurm fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oobleck_hpc.errors import ConfigError, OobleckError
from oobleck_hpc.files import write_json
from oobleck_hpc.fleet import cli as fleet_cli
from oobleck_hpc.fleet.manager import Action, Drain, Grow, JobState, Manager, Start, Stop
from oobleck_hpc.launch.fleet_job import POLL_S, STATE, FleetJobRun, process_start
from oobleck_hpc.launch.fleet_pool import SlurmPool
from oobleck_hpc.records.events import EventLog
STOP_GRACE_S = 30.0
"""Seconds the jobs get to stop after a forwarded signal before they are killed."""
ACTIONS: dict[str, type] = {"start": Start, "drain": Drain, "grow": Grow, "stop": Stop}


@dataclass
class FleetRun:
    path: Path
    run_dir: Path
    resume: bool = False
    pool: SlurmPool | None = None
    """A Slurm fleet's allocation (`fleet submit`): which job holds which node
    (launch/fleet_pool.py); None: local nodes."""
    jobs: dict[str, FleetJobRun] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    seq: int = 0
    """Actions decided so far (each action's number: the tag of a grow)."""
    pending: list[tuple[int, Action]] = field(default_factory=list)
    """Actions decided and not done yet, with their numbers."""
    log: EventLog = field(init=False)
    _unwritten: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _stop: bool = False

    def run(self) -> int:
        from oobleck_hpc.fleet.config import load_fleet
        from oobleck_hpc.fleet.curves import job_curve

        fleet, entries = load_fleet(self.path)
        events = self.run_dir / "events.jsonl"
        saved = self._saved() if self.resume else None
        if self.pool is not None and saved is not None:
            self.pool.held = saved.get("pool") or {}
        if saved is None and events.exists():
            raise ConfigError("<command line>", "--run-dir", f"value {str(self.run_dir)!r} "
                              "holds a fleet run already", "give the fleet a new --run-dir, or "
                              "add --resume to take it over if its manager died")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(events, source="fleet")
        states = []
        for fj in entries:
            c = job_curve(fj, fleet.pool.nodes)
            states.append(JobState(fj.name, c.waf, fj.entry.min_nodes, fj.entry.max_nodes,
                                   fj.entry.transition_s))
            self.jobs[fj.name] = FleetJobRun(fj.name, fleet.job_path(fj.entry).resolve(),
                                             self.run_dir / fj.name)
        manager = Manager(states, fleet.pool.nodes, fleet.mtbf_hours * 3600,
                          lambda kind, **f: self._unwritten.append((kind, f)))
        t0 = time.monotonic()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if saved is not None:
                self._take_over(manager, saved)
            else:
                first = manager.start()
                manager.emit("fleet_started", fleet=fleet.name, pool=fleet.pool.nodes,
                             nodes=manager.counts(), waf=manager.waf_now(),
                             run_dirs={n: str(j.run_dir) for n, j in self.jobs.items()})
                self._decided(manager, first)
            self._loop(manager)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for job in self.jobs.values():
                job.stop(STOP_GRACE_S if self._stop else 5.0)
            self.log.emit("fleet_ended", codes=self.codes, code=self._code(),
                          seconds=round(time.monotonic() - t0, 3))
            self.log.close()
        return self._code()

    def _code(self) -> int:
        """The fleet's exit code (module docstring)."""
        bad = [c for c in self.codes.values() if c != 0]
        if bad:
            return bad[0]
        return 0 if len(self.codes) == len(self.jobs) else 3  # (a job never got nodes)

    # -- the records (module docstring) ---------------------------------------------------

    def _saved(self) -> dict[str, Any]:
        """The records of a fleet whose manager is gone (else a ConfigError that says why)."""
        path = self.run_dir / STATE
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError("<command line>", "--resume", f"{path} cannot be read ({e})",
                              "give --run-dir the run dir of a fleet started by `oobleck-hpc "
                              "fleet run`") from None
        if process_start(saved["pid"]) == saved["pid_start"]:
            raise ConfigError("<command line>", "--resume", f"the fleet's manager (pid "
                              f"{saved['pid']}) still runs", "stop it first (SIGTERM stops "
                              "the jobs too; SIGKILL only the manager), or leave it be")
        if saved.get("ended"):
            raise ConfigError("<command line>", "--resume", f"the fleet in {self.run_dir} "
                              "ended", "start it again with a new --run-dir")
        return saved

    def _save(self, manager: Manager, ended: bool = False) -> None:
        write_json(self.run_dir / STATE, {
            "pid": os.getpid(), "pid_start": process_start(os.getpid()), "t": time.time(),
            "ended": ended, "manager": manager.snapshot(), "codes": self.codes,
            "seq": self.seq, "log_size": self._log_size(),
            "pool": self.pool.held if self.pool is not None else None,
            "pending": [{"id": i, "action": type(a).__name__.lower(), **asdict(a)}
                        for i, a in self.pending],
            "unwritten": [[k, f] for k, f in self._unwritten],
            "jobs": {n: {"pid": j.pid, "pid_start": j.pid_start, "attempt": j.attempt,
                         "watching": j.watching,
                         "offset": j.tail.offset if j.tail is not None else None}
                     for n, j in self.jobs.items()}})

    def _log_size(self) -> int:
        try:
            return (self.run_dir / "events.jsonl").stat().st_size
        except FileNotFoundError:
            return 0

    def _take_over(self, manager: Manager, saved: dict[str, Any]) -> None:
        """Go on from a dead manager's records (module docstring)."""
        manager.restore(saved["manager"])
        self.seq, self.codes = int(saved["seq"]), dict(saved["codes"])
        for name, job in saved["jobs"].items():
            if job["attempt"] is not None:
                self.jobs[name].adopt(job)
        if self._log_size() == saved["log_size"]:  # (it died before it wrote them)
            self._unwritten = [(k, f) for k, f in saved["unwritten"]]
        self.pending = [(d["id"], ACTIONS[d["action"]](**{k: v for k, v in d.items()
                                                           if k not in ("id", "action")}))
                        for d in saved["pending"]]
        manager.emit("fleet_resumed", pid=os.getpid(), since_s=round(time.time() - saved["t"], 3),
                     pending=[d["action"] for d in saved["pending"]],
                     jobs={n: j.state for n, j in manager.jobs.items()})
        self._decided(manager, [])

    def _decided(self, manager: Manager, actions: list[Action]) -> None:
        """Record, write and do what an event made the manager decide (module docstring)."""
        if self._stop:  # (stopping: nothing starts, nothing moves)
            actions = []
        for a in actions:
            self.seq += 1
            self.pending.append((self.seq, a))
        if not self.pending and not self._unwritten:
            return
        self._save(manager)
        for kind, fields in self._unwritten:
            self.log.emit(kind, **fields)
        self._unwritten.clear()
        while self.pending and not self._stop:
            i, a = self.pending[0]
            self._do(manager, i, a)
            self.pending.pop(0)
            self._save(manager)

    def _do(self, manager: Manager, i: int, a: Action) -> None:
        from oobleck_hpc.control.drain import request_drain
        from oobleck_hpc.launch.local import grow

        job = self.jobs[a.job]
        if isinstance(a, Start):
            if job.attempt == a.attempt or job.find(a.attempt):
                return  # (done before the manager died)
            try:
                on = self._take(manager, a.job, a.count, f"start-{a.attempt}")
            except TimeoutError as e:
                raise OobleckError(f"fleet {self.run_dir}: cannot start {a.job}: {e}") from None
            pid = job.start(a.count, a.attempt, on)
            self.log.emit("fleet_job_started", job=a.job, nodes=a.count,
                          run_dir=str(job.run_dir), pid=pid, attempt=a.attempt,
                          on_nodes=on or [])
        elif isinstance(a, Stop):
            if job.alive() and job.pid is not None:  # (it checkpoints and exits 75)
                os.kill(job.pid, signal.SIGTERM)
        elif isinstance(a, Drain):
            if a.node in manager.draining:  # (not answered yet)
                request_drain(job.run_dir, [a.node], by="fleet")
        elif isinstance(a, Grow):
            try:
                on = self._take(manager, a.job, a.count, f"fleet-{i}")
                names = grow(job.run_dir, a.count, tag=f"fleet-{i}", alive=job.alive, on=on)
            except (OSError, RuntimeError, TimeoutError) as e:
                self.log.emit("fleet_move_failed", job=a.job, reason=f"grow: {e}")
                return
            self.log.emit("fleet_grow", job=a.job, nodes=names, from_job=a.from_job)

    def _take(self, manager: Manager, job: str, count: int, tag: str) -> list[str] | None:
        """A Slurm fleet's nodes for an action (launch/fleet_pool.py), in the records before
        the job hears of them; None for local nodes (its launcher names them)."""
        if self.pool is None:
            return None
        nodes = self.pool.take(job, count, tag, {n: j.run_dir for n, j in self.jobs.items()},
                               lambda n: self.jobs[n].watching)
        self._save(manager)
        return nodes

    # -- the loop ---------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        self._stop = True
        for job in self.jobs.values():
            if job.proc is not None and job.proc.poll() is None:
                job.proc.send_signal(signum)
            elif job.alive() and job.pid is not None:
                os.kill(job.pid, signum)

    def _loop(self, manager: Manager) -> None:
        while True:
            watched = [j for j in self.jobs.values() if j.watching]
            if not watched:
                break  # every started job ended, and the last end started none
            for job in watched:
                self._read(manager, job)
            time.sleep(POLL_S)
        self._save(manager, ended=True)

    def _read(self, manager: Manager, job: FleetJobRun) -> None:
        """The job's new events, then its end if its launcher exited."""
        self._events(manager, job)
        if job.exit_code() is not None:
            self._events(manager, job)  # (its last ones: they are all there once it exited)
            code = job.exit_code()
            assert code is not None
            self.codes[job.name], job.watching = code, False
            self._decided(manager, manager.on_exit(job.name, code, code == 0))

    def _events(self, manager: Manager, job: FleetJobRun) -> None:
        assert job.tail is not None
        for e in job.tail.read():  # (its offset moves per event: `_save` records it)
            if e.get("kind") == "run_ended" and e.get("attempt") == job.attempt:
                job.ended = e
            self._decided(manager, manager.on_event(job.name, e))


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is None:
        from oobleck_hpc.fleet.config import load_fleet

        fleet, _ = load_fleet(args.fleet)
        run_dir = Path("runs") / fleet.name
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pool = None
    if args.slurm:
        from oobleck_hpc.bootstrap.environment import detect

        env = detect()
        if env.source != "slurm":
            raise ConfigError("<command line>", "--slurm", "is given outside a Slurm "
                              "allocation (SLURM_JOB_ID is not set)", "run it in the batch "
                              "script of an allocation, or submit the fleet: `oobleck-hpc "
                              "fleet submit FLEET`")
        pool = SlurmPool(env.job_id)
    return FleetRun(Path(args.fleet), run_dir, resume=args.resume, pool=pool).run()


def register(sub: argparse._SubParsersAction) -> None:
    """`fleet plan` and `fleet status` (fleet/cli.py), `fleet run` (here: it starts jobs),
    `fleet submit` (launch/cli_slurm.py) and `fleet chaos` (operate/fleet_chaos.py)."""
    fleet_sub = fleet_cli.register(sub)
    p = fleet_sub.add_parser("run", help="run every job of the fleet on this machine, and the "
                             "manager that moves nodes between them")
    p.add_argument("fleet", help="YAML fleet file")
    p.add_argument("--run-dir", default=None,
                   help="the fleet's run dir: its events, and each job's run dir under it "
                        "(default: runs/<fleet name>)")
    p.add_argument("--resume", action="store_true",
                   help="take over the fleet in --run-dir whose manager died (its jobs train "
                        "on): from its records, DIR/manager.json")
    p.add_argument("--slurm", action="store_true",
                   help="in a Slurm allocation (what `fleet submit` runs in its batch script): "
                        "each job's agents run as steps on nodes of the allocation")
    p.set_defaults(func=run)
    from oobleck_hpc.launch import cli_slurm
    from oobleck_hpc.operate import fleet_chaos

    cli_slurm.register_fleet(fleet_sub)
    fleet_chaos.register(fleet_sub)
