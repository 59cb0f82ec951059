"""The embedded local launcher (`launch: local`): pretend nodes as per-node agents on this machine.

`LocalRun(job, ...).run()` starts one node agent per node of the job ("node0", "node1", ...: each
`python -m oobleck_hpc.control.agent` in its own session, owning its `gpus_per_node` workers
`python -m oobleck_hpc.train`; launch/local_agents.py) and waits. Nothing is hosted here: the control
plane runs between the agents and generation 0's rendezvous store is hosted by a worker of the
first node (later ones by a survivor), so the launcher is no single point of failure either.

- A node lost mid-run (a `faults:` entry, `oobleck-hpc kill-node RUN_DIR NODE` from another
  shell, a node that leaves early) is recovered in place by the survivors; its agent's exit (a
  signal, 3 when it was lost or excluded, 75 when it could not prove it was in the majority)
  does not end the job.
- The job is over when every agent has exited or is stopped (SIGSTOP: a stopped node outliving
  the others can never finish alone), or `cluster.kill_grace_s` after the run finished (its
  `run_finished` event: the last step is committed; the others exit within moments) or after a
  forwarded stop signal. What is left then is killed. An agent that exits, with any code,
  ends nothing: a drained, excluded or lost node leaves while the others train on.
- Exit code (`job_exit_code`): the run's verdict (oobleck_hpc/records/runs.py, the one rule of every
  launcher): 0 only if the run finished -- its last step committed -- whoever was lost on the
  way; else 2 if any node reported bad input; else 75 if any node asked for a requeue
  (checkpoint fallback, no quorum, a stop signal); else 3. An agent's own exit code says how
  its node ended (oobleck_hpc/control/agent.py). On 2 the bad input's error is printed.
- Ctrl-C / SIGTERM: forwarded to every agent (which forward them to their workers), then as
  above; `stopped` says so, and the requeue loop does not start the job again (launch/requeue.py).
- RUN_DIR/agents.json names each node's agent pid (its process group): what kill-node uses.
- Growing (`oobleck-hpc grow RUN_DIR --nodes k` from another shell, `grow()`): a request file in
  RUN_DIR/grow/ that the launcher answers by starting k more agents (`LocalAgents.add`: new
  nodes at the end of the roster, outside generation 0). They join like spares: a round adds
  them while the job runs on fewer nodes than it started with (control/membership.py, step 7),
  else they wait for the next loss. The answer names them; agents.json lists them. A request
  file the job's user does not own is not read (runs.read_own): a `request_ignored` event
  says why, and the file is removed.
- `on_nodes` (`oobleck-hpc run JOB --on-nodes n1,n2` inside a Slurm allocation: a job of a
  Slurm fleet) runs the same launcher with the agents as one-node Slurm steps on those nodes
  instead of local process groups (launch/slurm_steps.py); a grow request then names its nodes.
- The console: rank 0's progress (its stdout), and one line per event that matters -- the plan,
  a fault, the agreement, the recovery with its time, a checkpoint, a fallback, the end --
  told from RUN_DIR/events.jsonl as it grows (`Console`, oobleck_hpc/records/story.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oobleck_hpc.records import runs
from oobleck_hpc.config import JobConfig
from oobleck_hpc.control.workers import process_state
from oobleck_hpc.errors import EXIT_BAD_INPUT
from oobleck_hpc.files import write_json
from oobleck_hpc.polling import wait_until
from oobleck_hpc.records.story import Story, Tail


@dataclass
class Console:
    """Prints the run's story (oobleck_hpc/records/story.py) from its events file as it grows; one for
    the whole run, across requeued attempts. `poll()` often, and once at the end. `run`: only
    that run's events (the file may still hold an earlier run's until the new one starts).
    `metrics` (with `every` and `total`): also a progress line every `every` steps from the
    metrics file (where rank 0's own output is not on this console: `submit --wait`)."""

    events: Path
    run: str = ""
    metrics: Path | None = None
    every: int = 10
    total: int = 0
    story: Story = field(default_factory=Story)
    out: Any = None
    _tails: tuple[Tail, Tail | None] | None = None

    def poll(self) -> None:
        if self._tails is None:
            self._tails = (Tail(self.events), Tail(self.metrics) if self.metrics else None)
        events, metrics = self._tails
        for e in events.read():
            if not self.run or e.get("run") == self.run:
                self._print(self.story.feed(e))
        for row in metrics.read() if metrics is not None else ():
            k = row.get("step", 0)
            if (not self.run or row.get("run") == self.run) and (
                    k % self.every == 0 or k == self.total):
                self._print([f"step {k}/{self.total}  loss {row['loss']:.4f}  "
                             f"{row['samples'] / max(row['seconds'], 1e-9):.1f} samples/s"])

    def _print(self, lines: list[str]) -> None:
        for line in lines:
            print(line, file=self.out or sys.stdout, flush=True)


@dataclass
class LocalRun:
    job: JobConfig
    job_path: Path
    run_dir: Path
    metrics: Path | None = None
    kill_grace_s: float | None = None
    """Default: the job's cluster.kill_grace_s (module docstring)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    console: Console | None = None
    """Where the story goes (None: nowhere; the agents' stdout goes to their logs then)."""
    on_nodes: list[str] | None = None
    """Nodes of the Slurm allocation this runs in, the agents one step each (a job of a Slurm
    fleet: launch/slurm_steps.py); None: local process groups."""
    agents: Any = None
    _signalled: float = 0.0
    _ignored: set[tuple] = field(default_factory=set)
    """Grow requests of other users already reported (runs.ForeignFile.key)."""

    @property
    def stopped(self) -> bool:
        """A stop signal reached this launcher (and was passed on to the agents)."""
        return bool(self._signalled)

    def _stopping_since(self, seconds: float) -> bool:
        """A stop signal was forwarded more than `seconds` ago (workers save at their next step
        boundary; one stuck before its first step does not hold the launcher)."""
        return bool(self._signalled) and time.monotonic() - self._signalled > seconds

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.job.cluster.nodes)]

    def run(self) -> int:
        from oobleck_hpc.launch.local_agents import LocalAgents

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **self.extra_env}
        if self.metrics is not None:
            env["OOBLECK_METRICS"] = str(self.metrics)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def forward(signum, _frame):
            self._signalled = self._signalled or time.monotonic()
            self.agents.forward(signum)

        if self.on_nodes is not None:
            from oobleck_hpc.launch.slurm_steps import SlurmSteps

            self.agents = SlurmSteps.start(self.run_dir, self.on_nodes, self.job, self.job_path,
                                           env)
        else:
            self.agents = LocalAgents.start(self.run_dir, self.node_names(),
                                            self.job.cluster.gpus_per_node, job=self.job_path,
                                            env=env, console=self.console is not None,
                                            spares=self.job.cluster.spares,
                                            group_access=self.job.group_access)
        self._write_agents()
        for s in old:
            signal.signal(s, forward)
        try:
            code = self._wait()
            if code == EXIT_BAD_INPUT:
                print(bad_input_message(self.run_dir, since=t_start), file=sys.stderr,
                      flush=True)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.agents.cleanup()
            if self.console is not None:
                self.console.poll()
        return code

    def _write_agents(self) -> None:
        write_json(self.run_dir / "agents.json", {m: p.pid for m, p in self.agents.procs.items()})

    def _wait(self) -> int:
        procs = self.agents.procs
        grace = self.kill_grace_s if self.kill_grace_s is not None else self.job.cluster.kill_grace_s
        run = runs.run_id(self.run_dir)
        events = Tail(self.run_dir / "events.jsonl")
        over_at: float | None = None  # when the job is over at the latest (module docstring)
        while True:
            codes = self.agents.poll()
            running = [m for m, c in codes.items() if c is None]
            if not running or all(process_state(procs[m].pid) in ("T", "t") for m in running):
                break  # nobody left who could train (a stopped node never finishes alone)
            if over_at is None and (any(runs.is_finished_event(e, run) for e in events.read())
                                    or self._stopping_since(5.0)):
                over_at = time.monotonic() + grace
            if over_at is not None and time.monotonic() > over_at:
                break
            if self.console is not None:
                self.console.poll()
            self._serve_grow()
            time.sleep(0.05)
        return job_exit_code(self.agents.poll(), self.run_dir, run, self.metrics)

    def _serve_grow(self) -> None:
        """Answer the grow requests in RUN_DIR/grow/ (module docstring)."""
        folder = self.run_dir / GROW_DIR
        if not folder.is_dir():
            return
        from oobleck_hpc.records.events import EventLog

        for request in sorted(folder.glob("*.request")):
            answer: dict[str, Any]
            try:
                asked = json.loads(runs.read_own(request))
                on = asked.get("on")
                if on is not None and not (isinstance(on, list) and all(
                        isinstance(n, str) and n and "/" not in n for n in on)):
                    raise ValueError(f"'on' must list node names, got {on!r}")
                names = self.agents.add(int(asked["nodes"]), on)
                answer = {"nodes": names}
                self._write_agents()
                log = EventLog(self.run_dir / "events.jsonl", source="launcher")
                log.emit("nodes_added", nodes=names, how="grow",
                         pids=[self.agents.procs[m].pid for m in names])
                log.close()
            except runs.ForeignFile as e:  # (not answered: its writer has no say in this job)
                if e.key not in self._ignored:
                    self._ignore(request, e.key, e.reason)
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                answer = {"error": f"{type(e).__name__}: {e}"}
            write_json(request.with_suffix(".done"), answer)
            request.unlink(missing_ok=True)

    def _ignore(self, request: Path, key: tuple, reason: str) -> None:
        """A grow request the job's user does not own: an event, and away with it (RUN_DIR/grow
        is the user's: its files can be removed whoever owns them; else it is told once)."""
        from oobleck_hpc.records.events import EventLog

        self._ignored.add(key)
        log = EventLog(self.run_dir / "events.jsonl", source="launcher")
        log.emit("request_ignored", request="grow", path=str(request), reason=reason)
        log.close()
        try:
            request.unlink(missing_ok=True)
        except OSError:
            pass


GROW_DIR = "grow"


def grow(run_dir: str | Path, count: int, timeout: float = 30.0, tag: str = "",
         alive: Callable[[], bool] | None = None, on: list[str] | None = None) -> list[str]:
    """Ask the launcher of the local job running in `run_dir` for `count` more nodes (from
    another process: module docstring); returns their names once their agents started.
    `tag` names the request, which makes asking again idempotent (the fleet manager, restarted
    from its records, repeats a grow it may have made): a request of that tag already
    answered is answered again, one still pending is waited for. `alive`: whether the
    launcher still runs (a caller that knows its pid): once it does not, no answer will
    come (RuntimeError at once rather than TimeoutError after `timeout`). `on`: the names of
    the new nodes (a job on Slurm steps grows on the allocation's nodes named: slurm_steps.py)."""
    run_dir = Path(run_dir)
    if count < 1:
        raise ValueError(f"--nodes {count}: grow by at least one node")
    if not (run_dir / "agents.json").exists():
        raise FileNotFoundError(f"{run_dir / 'agents.json'} does not exist: is a local job "
                                f"running with run dir {run_dir}? (`oobleck-hpc run` writes it "
                                "at start)")
    request = request_grow(run_dir, count, tag, on)
    done = request.with_suffix(".done")
    try:
        wait_until(lambda: done.exists() or (alive is not None and not alive()), timeout,
                   f"the launcher of the job in {run_dir} to answer (is it still running?)",
                   every_s=0.05)
        if not done.exists():
            raise RuntimeError(f"the launcher of the job in {run_dir} ended before it answered")
    except (TimeoutError, RuntimeError):
        request.unlink(missing_ok=True)  # a launcher that comes back must not act on it
        raise
    answer = json.loads(done.read_text())
    if not tag:
        done.unlink()  # (a tagged answer stays: the tag's owner may ask again)
    if "error" in answer:
        raise RuntimeError(f"the launcher could not grow the job: {answer['error']}")
    return list(answer["nodes"])


def request_grow(run_dir: str | Path, count: int, tag: str = "",
                 on: list[str] | None = None) -> Path:
    """Write a request for `count` more nodes that the running local job's launcher answers
    (`grow` waits for its answer; the `grow` fault does not); returns the request file. A
    `tag` already asked for (its request or its answer there) is not asked again."""
    folder = Path(run_dir) / GROW_DIR
    folder.mkdir(exist_ok=True)
    request = folder / f"{tag or f'{os.getpid()}-{time.time_ns()}'}.request"
    if not (tag and (request.exists() or request.with_suffix(".done").exists())):
        write_json(request, {"nodes": count, **({"on": list(on)} if on else {})})
    return request


def job_exit_code(codes: dict[str, int | None], run_dir: Path, run: str | None = None,
                  metrics: Path | None = None) -> int:
    """The job's exit code (module docstring): the run's verdict from its record
    (`runs.outcome`) and the agents' codes. None (still running when the job ended: killed)
    and signals count as lost nodes."""
    finished = runs.outcome(run_dir, run, metrics).finished
    return runs.verdict(finished, [c for c in codes.values() if c is not None])


def bad_input_message(run_dir: Path, since: float = 0.0) -> str:
    """The console line for a job that ended with 2: the first node's reason (its `agent_exit`
    event) and the last error line of its log (the worker's own message)."""
    from oobleck_hpc.records.events import read_events

    path = Path(run_dir) / "events.jsonl"
    evs = [e for e in read_events(str(path)) if e.get("t", 0) >= since] if path.exists() else []
    first = next((e for e in evs if e.get("kind") == "agent_exit"
                  and e.get("code") == EXIT_BAD_INPUT and e.get("how") == "abort"), None)
    if first is None:
        return f"oobleck-hpc run: error: bad input (exit 2); see {Path(run_dir) / 'logs'}"
    node = first.get("source", "?")
    log = Path(run_dir) / "logs" / f"agent-{node}.log"
    lines = [x for x in log.read_text(errors="replace").splitlines() if "error:" in x] \
        if log.exists() else []
    detail = f"\n  {lines[-1].strip()}" if lines else ""
    return (f"oobleck-hpc run: error: bad input on {node}: {first.get('reason')} (log: {log})"
            + detail)


def kill_node(run_dir: str | Path, node: str, sig: int = signal.SIGKILL) -> float:
    """Kill (or hang: SIGSTOP) one node of a running local job from another shell; returns the
    time the signal was sent. The command's own light module does it (operate/kill.py)."""
    from oobleck_hpc.operate.kill import kill_node as send

    return send(run_dir, node, sig)
