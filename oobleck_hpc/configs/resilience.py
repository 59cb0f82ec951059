"""The job file's sections about surviving failures: `fault_tolerance` (in-place recovery, the
control plane's timing, stragglers, drains, replacements), `checkpoint` (the fallback beyond the
guarantee) and `faults` (failures injected for tests and demos); and the control plane's
defaults, which the agents take from here without reading a job file.

Part of the job file's dataclasses (config.py imports them from here; import them from
`oobleck_hpc.config`). Every default is declared once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oobleck_hpc.schema import Where as _Where

# The control plane's defaults, here once: the job file's fault_tolerance, the agent's flags
# (control/agent_options.py), control/plane.py's constructor and the protocol simulator
# (testing/netsim.py) take them from here, through oobleck_hpc.config. (Importing this module
# imports no torch.)
HEARTBEAT_S = 0.5
"""Interval of the agents' heartbeats on the control plane."""
LEASE_S = 3.0
"""A node whose heartbeat is older than this is declared lost."""
STARTUP_S = 60.0
"""How long the agents wait for each other's first connection at start."""
FENCED_GRACE_S = 2.0
"""How long a fenced node's workers get to exit before its agent kills them."""
# In-band hang detection (recovery/stall.py, control/stall_probe.py): a worker that
# waits inside one of a step's communications (a transfer, a collective, the commit vote)
# longer than max(STALL_FLOOR_S, STALL_MULTIPLE x its usual step time) reports a stall; its
# agent pings the suspects and suspects those silent after STALL_PROBE_S. A false stall report
# costs a few pings (every agent answers: nothing happens); a false suspicion costs a healthy
# node, so the threshold may be low and the probe's deadline must not be.
STALL_FLOOR_S = 0.3
"""No wait shorter than this is a stall, however short the steps: a descheduled peer on a
loaded machine (tens to a few hundred ms) makes a step that long now and then (then its agent
answers the ping: nothing happens). Not higher: hang -> first committed step is about this +
STALL_PROBE_S + the recovery's ~0.3 s, which must stay under 1 s (with 0.4 it measured
1.05-1.09 s on the 2-core machine, `bench/recovery.py --modes hang`). It matters only for
steps shorter than 0.15 s: past that, STALL_MULTIPLE x the step decides."""
STALL_MULTIPLE = 2.0
"""A wait is a stall past this many times the usual step time (the low median of the last
STALL_STEPS committed steps, the slowest rank's time): no single wait of a healthy step lasts
a whole step, and a node slowed up to this many times is not even reported (slowed more, its
agent answers the ping: a straggler keeps its own path, recovery/straggler.py). With 3, the
demo's 0.13 s steps made the threshold 0.39-0.41 s, above STALL_FLOOR_S, and a hang cost
1.05-1.09 s."""
STALL_STEPS = 8
"""Committed steps whose low median is the usual step time (the first ones allocate: the low
median forgets them)."""
STALL_PROBE_S = 0.35
"""How long an agent waits for a stalled worker's suspects to answer its ping. A SIGSTOPped
agent never answers; a live one answered within 0.4-2.6 ms on this 2-core machine, quiet or
under a CPU hog (the stall_probed event's answered_s, control/stall_probe.py), so an agent
descheduled for 200 ms is still not suspected. Hang -> removed ~= STALL_FLOOR_S + this + a
round: ~0.9 s. The floor of the deadline: on a machine that has left agents unscheduled lately
(late heartbeats), the probe waits longer (control/stall_probe.py)."""


@dataclass
class FaultToleranceConfig:
    f: int = 1
    """Simultaneous node losses survived in place (at least f+1 pipelines are kept)."""
    collective_timeout_s: float = 5.0
    """torch.distributed timeout: bounds how long a hung peer can stall a collective."""
    heartbeat_s: float = HEARTBEAT_S
    """Interval of the agents' heartbeats on the control plane."""
    lease_s: float = LEASE_S
    """A node whose heartbeat is older than this is declared lost (catches hangs, partitions)."""
    replace: bool = False
    """Under Slurm: after a loss the job submits a replacement job (its partition, account, QOS
    and constraints, the time it has left) whose agents join the running job; replacements end
    with the job (launch/slurm.py). Locally, `oobleck-hpc grow` adds nodes by hand."""
    straggler: Literal["auto", "none", "rebalance", "exclude"] = "auto"
    """A node persistently slower than the others (recovery/straggler.py): auto takes what the
    planner predicts fastest (keep, re-split the batch, exclude the node); rebalance or
    exclude force that action; none turns detection off."""
    straggler_ratio: float = 1.5
    """A node is a straggler when its computations take at least this many times the median
    node's (relative to what the profile predicts for each) ..."""
    straggler_steps: int = 5
    """... in the median over its last this many committed steps (recovered: <= 1.2) ..."""
    straggler_window_s: float = 10.0
    """... and over at least this many seconds of steps: a slowdown is persistent only if it
    lasts both (short steps on a shared machine vary by far more than long ones)."""
    drain_poll_s: float = 30.0
    """Under Slurm: how often each node's agent asks slurmctld whether an administrator set its
    node to DRAIN (`scontrol update nodename=... state=drain`); the node then leaves the job at
    a step boundary, nothing replayed (control/drain.py). 0: never ask."""

    def check(self, where: _Where) -> None:
        if self.straggler_ratio <= 1:
            where.fail("straggler_ratio", self.straggler_ratio, "must exceed 1",
                       "use e.g. 1.5: a node 50 % slower than the median node")
        if self.straggler_window_s < 0:
            where.fail("straggler_window_s", self.straggler_window_s, "must be >= 0",
                       "use e.g. 10: a slowdown must last that long to count")
        if self.straggler_steps < 1:
            where.fail("straggler_steps", self.straggler_steps, "must be >= 1",
                       "use a few steps, e.g. 5, so that one noisy step decides nothing")
        if self.drain_poll_s < 0:
            where.fail("drain_poll_s", self.drain_poll_s, "must be >= 0",
                       "use a few tens of seconds, or 0 not to watch the node's Slurm state")
        if self.f < 0:
            where.fail("f", self.f, "must be >= 0", "use 0 to disable in-place recovery")
        for key in ("collective_timeout_s", "heartbeat_s", "lease_s"):
            if getattr(self, key) <= 0:
                where.fail(key, getattr(self, key), "must be positive", "use a few seconds")
        if self.lease_s <= self.heartbeat_s:
            where.fail("lease_s", self.lease_s, f"must exceed heartbeat_s={self.heartbeat_s}",
                       "use a lease of several heartbeats, e.g. 6x")


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Shared directory for checkpoints; none: no checkpoints (fallback impossible)."""
    every_steps: int = 0
    """Save every this many steps (0: not by steps)."""
    every_minutes: float = 0.0
    """Save every this many minutes of wall time (0: not by time)."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted after a newer one is published."""

    def check(self, where: _Where) -> None:
        if self.every_steps < 0 or self.every_minutes < 0:
            where.fail("every_steps", self.every_steps, "intervals must be >= 0", "use 0 to disable")
        if self.keep < 1:
            where.fail("keep", self.keep, "must be at least 1", "keep at least the latest")


@dataclass
class FaultConfig:
    node: int
    """Index of the node (0-based, in the job's initial node order) that fails."""
    step: int
    """The training step during which the fault fires, numbered from 1 as on the console and
    in the metrics file (1 = the first step); for rendezvous and restore, the first step the run
    is about to train; for checkpoint, the step after which the save runs."""
    phase: Literal["forward", "backward", "gradient_sync", "reduce", "prepared", "vote",
                   "optimizer", "commit", "checkpoint", "reconfiguration", "transfer",
                   "rendezvous", "restore"] = "forward"
    """Where in the step (or around it) the fault fires; control/faults.py lists every window:
    forward, backward, gradient_sync (the per-layer gradient all-reduces); reduce (inside the
    step's final statistics all-reduce, after this rank posted it); prepared (after that
    all-reduce, before the commit vote); vote (this rank's vote sent, the outcome not known);
    optimizer (the vote passed, before the update); commit (this rank applied the update, its
    peers may not have yet); checkpoint (inside a periodic save); reconfiguration (survivors
    agreed, before the groups are rebuilt); transfer (during the layer-state transfer);
    rendezvous (the generation-0 rendezvous, `step` = the step the run starts at); restore
    (loading the checkpoint, same `step`)."""
    kind: Literal["kill", "hang", "exit", "crash", "drain", "slow", "grow"] = "kill"
    """kill: SIGKILL of the node (agent + workers); hang: SIGSTOP of the node; exit: the node
    leaves cleanly; crash: one worker process of a live node dies; drain: the node is asked to
    drain (as by `oobleck-hpc drain`: it leaves at the next step boundary, nothing replayed);
    slow: the node's workers run `factor` times slower from then on (its agent stops and
    continues them on a duty cycle); grow: the node asks the local launcher for one more node
    (as `oobleck-hpc grow RUN_DIR --nodes 1` does), which joins after a loss or waits as a
    spare -- `node` only says whose worker asks."""
    factor: float = 2.0
    """slow: how many times slower (> 1)."""

    def check(self, where: _Where) -> None:
        if self.factor <= 1:
            where.fail("factor", self.factor, "must exceed 1", "use e.g. 2.0: twice as slow")
