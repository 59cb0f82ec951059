"""The embedded local launcher (`launch: local`): pretend nodes as per-node agents on this machine.

`launch_local(job)` starts one node agent per node of the job ("node0", "node1", ...: each
`python -m oobleck_hpc.agent` in its own session, owning its `gpus_per_node` workers
`python -m oobleck_hpc.train`; elastic/local.py) and waits. Nothing is hosted here: the control
plane runs between the agents and generation 0's rendezvous store is hosted by a worker of the
first node (later ones by a survivor), so the launcher is no single point of failure either.

- A node lost mid-run (a `faults:` entry, `oobleck-hpc kill-node RUN_DIR NODE` from another
  shell) is recovered in place by the survivors; its agent's exit (a signal, or 3 when fenced)
  does not end the job.
- Exit code: 0 when the job finished (some agent finished with 0 and every other exit is a lost
  node); otherwise the largest intended code (2 bad input, 75 requeue: oobleck_hpc/errors.py), or
  3 when every node was lost. Once one agent finished, the others get `kill_grace_s` to finish
  too; a node still around after that (e.g. a SIGSTOPped one) is killed.
- Ctrl-C / SIGTERM: forwarded to every agent (which forward them to their workers), then as above.
- RUN_DIR/agents.json names each node's agent pid (its process group): what kill-node uses.
- After the run, a summary of the recoveries (what died, when, how long to the first committed
  step) is printed from RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oobleck_hpc.config import JobConfig
from oobleck_hpc.elastic.local import _state

EXIT_NODE_LOST = 3


@dataclass
class LocalRun:
    job: JobConfig
    job_path: Path
    run_dir: Path
    metrics: Path | None = None
    kill_grace_s: float = 20.0
    extra_env: dict[str, str] = field(default_factory=dict)
    console: bool = True
    agents: Any = None
    _signalled: float = 0.0

    def _stopping_since(self, seconds: float) -> bool:
        """A stop signal was forwarded more than `seconds` ago (workers save at their next step
        boundary; one stuck before its first step does not hold the launcher)."""
        return bool(self._signalled) and time.monotonic() - self._signalled > seconds

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.job.cluster.nodes)]

    def run(self) -> int:
        from oobleck_hpc.elastic.local import LocalAgents

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)
            self.metrics.write_text("")  # this run's steps only
        events = self.run_dir / "events.jsonl"
        t_start = time.time()
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **self.extra_env}
        if self.metrics is not None:
            env["OOBLECK_METRICS"] = str(self.metrics)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def forward(signum, _frame):
            self._signalled = self._signalled or time.monotonic()
            for p in self.agents.procs.values():
                if p.poll() is None:
                    try:
                        p.send_signal(signum)
                    except ProcessLookupError:
                        pass

        self.agents = LocalAgents.start(self.run_dir, self.node_names(),
                                        self.job.cluster.gpus_per_node, job=self.job_path,
                                        env=env, console=self.console)
        (self.run_dir / "agents.json").write_text(json.dumps(
            {m: p.pid for m, p in self.agents.procs.items()}, indent=1) + "\n")
        for s in old:
            signal.signal(s, forward)
        try:
            code = self._wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.agents.cleanup()
        text = recovery_summary(events, since=t_start)
        if text:
            print(text, flush=True)
        return code

    def _wait(self) -> int:
        procs = self.agents.procs
        while True:
            codes = {m: p.poll() for m, p in procs.items()}
            finished = [c for c in codes.values() if c is not None]
            if 0 in finished or len(finished) == len(codes) or self._stopping_since(5.0):
                # The job is over: the other survivors finish within moments; a stopped (hung)
                # node never will and is not waited for.
                deadline = time.monotonic() + self.kill_grace_s
                while time.monotonic() < deadline and any(
                        p.poll() is None and _state(p.pid) not in ("T", "t")
                        for p in procs.values()):
                    time.sleep(0.05)
                codes = {m: p.poll() for m, p in procs.items()}
                return job_exit_code(codes)
            time.sleep(0.05)


def job_exit_code(codes: dict[str, int | None]) -> int:
    """The job's exit code from its agents' (module docstring). None: still running (killed)."""
    intended = [c for c in codes.values() if c is not None and c > 0 and c != EXIT_NODE_LOST]
    if intended:
        return max(intended)
    if any(c == 0 for c in codes.values()):
        return 0
    return EXIT_NODE_LOST


def recovery_summary(events_path: Path, since: float = 0.0) -> str:
    """Human lines for the run's recoveries: what died, when, how long from the fault (or the
    first sign of the failure) to the first committed step on the new plan."""
    from oobleck_hpc.elastic.events import read_events

    if not Path(events_path).exists():
        return ""
    evs = [e for e in read_events(str(events_path)) if e.get("t", 0) >= since]
    lines = []
    t_prev = since
    for e in evs:
        if e.get("kind") != "recovered":
            continue
        window = [x for x in evs if t_prev <= x["t"] <= e["t"]]
        faults = [x for x in window if x["kind"] in ("fault_injected", "node_killed")]
        seen = [x for x in window if x["kind"] == "step_failed"]
        t0 = faults[0]["t"] if faults else (seen[0]["t"] if seen else e["t"] - e.get("seconds", 0))
        how = (f"{faults[0].get('fault', 'kill')} ({faults[0].get('phase', 'from outside')})"
               if faults else "failure")
        lines.append(f"  step {e['step']}: lost {', '.join(e.get('lost', []))} by {how}; first "
                     f"step committed on plan {e.get('plan')} {e['t'] - t0:.2f} s later "
                     f"({e.get('rounds', 1)} round(s), {e.get('bytes_moved', 0) / 1e6:.2f} MB "
                     f"of layer state moved)")
        t_prev = e["t"]
    if not lines:
        return ""
    return f"recoveries ({len(lines)}, in place, no restart):\n" + "\n".join(lines)


def kill_node(run_dir: str | Path, node: str, sig: int = signal.SIGKILL) -> float:
    """Kill one node of a running local job from another shell: `sig` to its agent's process
    group (agent + workers). Returns the time it was sent (also written to the events)."""
    from oobleck_hpc.elastic.events import EventLog

    path = Path(run_dir) / "agents.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is a local job running with run dir "
                                f"{run_dir}? (`oobleck-hpc run` writes it at start)")
    pids = json.loads(path.read_text())
    if node not in pids:
        raise KeyError(f"node {node!r} is not part of the job in {run_dir} (nodes: "
                       f"{', '.join(pids)})")
    log = EventLog(Path(run_dir) / "events.jsonl", source="kill-node")
    t = time.time()
    log.emit("node_killed", node=node, signal=signal.Signals(sig).name, pid=pids[node])
    os.killpg(pids[node], sig)
    return t


def launch_local(job: JobConfig, job_path: str | Path, metrics: str | Path | None = None,
                 run_dir: str | Path | None = None) -> int:
    """Run the job on this machine; returns the exit code (see module docstring)."""
    run = LocalRun(job, Path(job_path), Path(run_dir or job.resolved_run_dir),
                   Path(metrics) if metrics else None)
    return run.run()
