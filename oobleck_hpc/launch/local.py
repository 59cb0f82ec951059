"""The embedded local launcher (`launch: local`): pretend nodes as groups of processes.

`launch_local(job)` hosts the rendezvous store (a TCPStore on a free port of 127.0.0.1), then
starts, for each of the job's `nodes` nodes ("node0", "node1", ...), its `gpus_per_node` worker
processes (`python -m oobleck_hpc.train`), and waits:

- all workers exit 0: the job is done, exit 0;
- a worker exits non-zero: the others get `kill_grace_s` to notice and exit on their own, then
  are killed; the launcher exits with the first non-zero code (0 / 2 / 3 / 75 as documented in
  oobleck_hpc/errors.py);
- Ctrl-C / SIGTERM: forwarded to every worker, then as above.

A worker learns who it is from ONE place: the OOBLECK_* environment written by
`NodeEnvironment.to_env()` (bootstrap/environment.py) -- node name, the job's nodes, local rank,
and in `extra`: job (the job file), run_dir, store (host:port), metrics. Workers are started per
node by `start_node`, so replacing it with the per-node agent (`python -m oobleck_hpc.agent`,
which starts the node's workers itself) changes that one function.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from oobleck_hpc.bootstrap.environment import NodeEnvironment, free_port
from oobleck_hpc.config import JobConfig


@dataclass
class LocalRun:
    job: JobConfig
    job_path: Path
    run_dir: Path
    metrics: Path | None = None
    kill_grace_s: float = 5.0
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.job.cluster.nodes)]

    def start_node(self, index: int, store: str) -> list[subprocess.Popen]:
        """Start one node's workers (the piece the per-node agent replaces)."""
        nodes = self.node_names()
        g = self.job.cluster.gpus_per_node
        out = []
        for local_rank in range(g):
            env_obj = NodeEnvironment(
                source="local", job_id=f"local-{os.getpid()}", node=nodes[index], nodes=nodes,
                task_rank=index * g + local_rank, local_rank=local_rank,
                num_tasks=len(nodes) * g,
                extra={"job": str(self.job_path.resolve()), "run_dir": str(self.run_dir),
                       "store": store, **({"metrics": str(self.metrics)} if self.metrics else {})})
            env = {**os.environ, **env_obj.to_env(), **self.extra_env}
            env.setdefault("OMP_NUM_THREADS", "1")  # CPU workers share the cores
            out.append(subprocess.Popen([sys.executable, "-m", "oobleck_hpc.train"], env=env))
        return out

    def run(self) -> int:
        import datetime

        import torch.distributed as dist

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)
            self.metrics.write_text("")  # this run's steps only
        port = free_port("127.0.0.1")
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def forward(signum, _frame):
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signum)

        for s in old:
            signal.signal(s, forward)
        try:
            for i in range(self.job.cluster.nodes):
                self.procs += self.start_node(i, f"127.0.0.1:{port}")
            return self._wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._kill_all()
            del store

    def _wait(self) -> int:
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                deadline = time.monotonic() + self.kill_grace_s
                while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                    time.sleep(0.05)
                return failed[0] if failed[0] > 0 else 3
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def launch_local(job: JobConfig, job_path: str | Path, metrics: str | Path | None = None,
                 run_dir: str | Path | None = None) -> int:
    """Run the job on this machine; returns the exit code (see module docstring)."""
    run = LocalRun(job, Path(job_path), Path(run_dir or job.resolved_run_dir),
                   Path(metrics) if metrics else None)
    return run.run()
