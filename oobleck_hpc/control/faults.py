"""Fault injection: the job file's `faults:` entries, fired from inside the workers.

    faults:
      - {node: 1, step: 3, phase: backward, kind: kill}
      - {node: 2, step: 3, phase: reconfiguration, kind: kill}

`node` is the index in the job's initial node order (the roster: node0, node1, ...), `step` the
training step during which the fault fires (numbered from 1, as on the console and in the
metrics file: the callers pass `engine.state.step + 1` for the step being run), `phase` the window
(config.FaultConfig.phase): forward, backward, gradient_sync, reduce, optimizer, commit (the
engine's `on_phase` hook: the moment the step enters that phase on a worker of the node);
prepared, vote (the driver's transactional commit: before this rank votes, and after its vote
was sent); reconfiguration, transfer (the reconfigure driver: after the survivors agreed, and
while layer state moves; `step` is the step being replayed); rendezvous, restore (the start of
a run: `step` is the first step it will train); checkpoint (the periodic save after step
`step`, once the snapshot was handed to the writer). A fault fires at
most once per process; the first worker of the node to get there fires it for the node.

Kinds, all acting on the whole node -- the node agent and its workers share one process group
(the local launcher starts each agent in its own session; under Slurm each srun task is one):

- kill: SIGKILL to the node's process group: agent and workers vanish at once, as when a machine
  dies (peers see dropped connections).
- hang: SIGSTOP to the node's process group: everything stops and nothing is closed (peers see
  silence: their workers' waits stall and its agent answers no ping -- recovery/stall.py --,
  its lease expires, collectives time out). Whoever runs the test resumes or kills it.
- exit: a clean early exit: every worker of the node that reaches the fault (or whose step fails
  at the fault's step) says `leave()` to its agent and exits 0; the agent leaves the job (BYE
  "early") and its peers recover without the node, as from any other loss.
- crash: SIGKILL to one worker process (local rank 0) of a live node: once the job trains, the
  node steps out at once (the others recover without it), its agent restarts its workers, and
  the node rejoins when they are ready, receiving its layers from replicas; a third crash of a
  local rank's worker, or one before the first committed step, fails the whole node
  (control/agent.py).
- slow: the node's agent stops and continues its workers (`DutyCycle`): from then on each
  second they compute is followed by factor - 1 seconds stopped, so their computation takes
  factor times as long, as on a throttled GPU or beside a noisy neighbour -- not a sleep
  in our own code path, which the straggler detector could see directly.
- drain: the node is asked to drain, as `oobleck-hpc drain RUN_DIR NODE` asks (the request
  file that its agent watches, control/drain.py): it finishes the step, and at a step boundary
  soon after (the first commit vote its workers join once the agent told them) it leaves with
  nothing replayed. Nothing is killed.
- grow: the node's worker asks the local launcher for one more node, as `oobleck-hpc grow
  RUN_DIR --nodes 1` asks (a request file in RUN_DIR/grow/, launch/local.py), without waiting
  for the answer: the new node joins at a step boundary while the job runs on fewer nodes than
  it started with, else waits as a spare for the next loss. Nothing is lost.

Each firing is written to the run's events first (`fault_injected`, with the time), so recovery
can be timed from the fault.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any, Sequence

from oobleck_hpc.config import FaultConfig
from oobleck_hpc.records.events import EventLog


IN_STEP_PHASES = ("forward", "backward", "gradient_sync", "reduce", "prepared", "vote",
                  "optimizer", "commit")
"""The windows inside a training step (the others: around it or during a recovery)."""


class DutyCycle:
    """Slows processes `factor` times, as a throttled device would: for whatever time they
    spent computing since the last look (every PERIOD_S: running or waiting for a CPU,
    /proc/PID/task/*/schedstat), they are then stopped (SIGSTOP ... SIGCONT) for factor - 1
    times as long. Their computation takes `factor` times as long as it would on this machine
    as loaded as it is; their waiting for peers or messages is not stretched. (A fixed duty
    cycle stretches both alike: stopped while idle, a process loses nothing, so a node that
    waits half the time looked ~1.5x slower, not 2x; CPU time alone misses the run-queue wait
    of a shared machine.) `pids()`: the processes, read each period (a restarted worker is
    slowed too). `stop()` lets them run again."""

    PERIOD_S = 0.02  # well under a step's compute, so that every step is slowed alike

    def __init__(self, pids, factor: float):
        import threading

        self.pids, self.factor = pids, factor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-fault", daemon=True)

    def start(self) -> DutyCycle:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._send(signal.SIGCONT)

    def _send(self, sig: int, pids=None) -> None:
        for pid in self.pids() if pids is None else pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def busy_s(pid: int) -> float | None:
        """Seconds process `pid`'s threads have spent on a CPU or runnable waiting for one."""
        total = 0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    on_cpu, waiting, _ = f.read().split()
                total += int(on_cpu) + int(waiting)
        except (OSError, ValueError):  # (gone, or a thread ended meanwhile: next period)
            return None
        return total / 1e9

    def _run(self) -> None:
        seen: dict[int, float] = {}
        owed = 0.0
        while not self._stop.wait(self.PERIOD_S):
            pids = self.pids()
            for pid in pids:
                used = self.busy_s(pid)
                if used is not None:
                    owed += (self.factor - 1) * max(0.0, used - seen.get(pid, used))
                    seen[pid] = used
            if owed > 0:
                self._send(signal.SIGSTOP, pids)
                self._stop.wait(owed)
                self._send(signal.SIGCONT, pids)
                owed = 0.0


@dataclass
class FaultInjector:
    """The faults of one node, as seen by one of its workers. Call it as the engine's on_phase."""

    faults: Sequence[FaultConfig]
    """The job's faults for THIS node only."""
    node: str
    local_rank: int
    events: EventLog | None = None
    client: Any = None
    """The worker's AgentClient (for `exit`: tell the agent the exit is intended)."""
    fired: set[int] = field(default_factory=set)

    @classmethod
    def for_node(cls, faults: Sequence[FaultConfig], node_index: int, node: str, local_rank: int,
                 events: EventLog | None = None, client: Any = None) -> FaultInjector:
        return cls([f for f in faults if f.node == node_index], node, local_rank, events, client)

    def skip_fired(self) -> FaultInjector:
        """A worker restarted after a crash (control/agent.py) may run steps its predecessor ran
        (its node rejoins at whichever step the members are at): the faults that predecessor
        fired (this run's events, same node, local rank and attempt) do not fire again."""
        from oobleck_hpc.records.events import read_events

        if self.events is None or self.events.path is None:
            return self
        me = f"{self.node}/{self.local_rank}"
        done = {(e.get("step"), e.get("phase"), e.get("fault"))
                for e in read_events(self.events.path) if e.get("kind") == "fault_injected"
                and e.get("source") == me and e.get("attempt") == self.events.attempt}
        self.fired |= {i for i, f in enumerate(self.faults) if (f.step, f.phase, f.kind) in done}
        return self

    def __call__(self, phase: str, step: int) -> None:
        for i, f in enumerate(self.faults):
            if i not in self.fired and f.phase == phase and f.step == step and (
                    f.kind not in ("drain", "crash", "slow", "grow") or self.local_rank == 0):
                self.fired.add(i)
                self.fire(f)

    def on_failed_step(self, step: int) -> None:
        """A step failed: a node that is to exit cleanly inside this step exits now (its worker
        may have been stopped by the exit of a local peer before it reached the fault's phase).
        An exit in a later window (reconfiguration, transfer, checkpoint) still waits for it."""
        for i, f in enumerate(self.faults):
            if (f.kind == "exit" and f.step == step and f.phase in IN_STEP_PHASES
                    and i not in self.fired):
                self.fired.add(i)
                self.fire(f)

    def fire(self, f: FaultConfig) -> None:
        if self.events is not None:
            self.events.emit("fault_injected", node=self.node, local_rank=self.local_rank,
                             step=f.step, phase=f.phase, fault=f.kind)
            self.events.close()
        if f.kind == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif f.kind == "hang":
            os.killpg(os.getpgid(0), signal.SIGSTOP)
        elif f.kind == "crash":  # this worker alone: its agent then fails the node
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exit":
            if self.client is not None:
                self.client.leave()
            os._exit(0)
        elif f.kind == "slow":
            if self.client is not None:
                self.client.slow(f.factor)
        elif f.kind == "drain":
            from oobleck_hpc.control.drain import request_drain

            if self.events is not None and self.events.path is not None:
                request_drain(self.events.path.parent, [self.node], by="fault")
        elif f.kind == "grow":
            from oobleck_hpc.launch.local import request_grow

            if self.events is not None and self.events.path is not None:
                request_grow(self.events.path.parent, 1)
        else:  # config validation admits only the kinds above
            raise ValueError(f"unknown fault kind {f.kind!r}")
