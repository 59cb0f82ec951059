"""The three fault-tolerance policies, as reactions to failures and arrivals.

Each policy asks a *backend* what it can run on a node set and what recovery costs; backends are
either tables of published measurements (sim/scenario.py, the paper preset) or our own planner
(sim/planner_backend.py). The policies themselves are the documented models:

oobleck (pipeline templates, in-place recovery)
    On a failure the step in flight is lost (it is replayed) and the job reconfigures in place:
    the backend returns the new plan and its cost (agreement + regroup + copy of the lost layers
    from surviving replicas). A failure during a reconfiguration joins it (both losses are
    handled by one reconfiguration from the last committed plan). When the losses exceed the
    guarantee (backend raises GuaranteeExceeded: some layer has no replica left or fewer than
    n0 nodes remain) the job falls back to its last checkpoint: everything since is lost, and a
    restart (requeue + reload) follows. Checkpoints are optional for oobleck
    (`checkpoint_s` is their blocking part; our checkpoints are asynchronous).

restart (checkpoint-restart, Varuna-like)
    Checkpoints every k steps, each blocking training for `checkpoint_s`. On a failure everything
    since the last completed checkpoint is lost (an interrupted checkpoint is worthless), the job
    restarts (`restart_s`: process start, rendezvous, reload) on the surviving nodes with the best
    homogeneous plan (nodes that do not fill a whole pipeline idle). A failure during a restart
    starts it over. A joining node idles until the next restart takes it (a restart costs
    minutes; Slurm's requeue picks up whatever nodes are there).

redundant (redundant computation, Bamboo-like)
    Every step carries redundant computation (each node also runs its successor's stage), so only
    a `useful` fraction of a step advances training. A single failure is absorbed: the
    predecessor fails over with the redundant copy (the step in flight is kept) and the pipelines
    are rebalanced on the remaining nodes (`reconfiguration_s`, booked as reconfiguration). A
    second failure while rebalancing after a failure (consecutive failures: the redundancy is
    already spent) is fatal: the job falls back to its last checkpoint and restarts
    (`restart_s`). A joining node idles until the next rebalancing takes it.
"""

from __future__ import annotations

from typing import Protocol

from oobleck_hpc.errors import GuaranteeExceeded
from oobleck_hpc.sim.engine import Policy, RunConfig
from oobleck_hpc.sim.recycle import RecyclePolicy


class Backend(Protocol):
    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        """A fresh configuration on `nodes` (None: too few nodes to run)."""

    def restart_s(self, nodes: int) -> float:
        """Cost of a restart from the checkpoint on `nodes` nodes."""


class InPlaceBackend(Backend, Protocol):
    def reconfigure(self, lost: tuple[str, ...], alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        """New configuration after losing `lost` (since the last committed plan) and its cost in
        seconds; raises GuaranteeExceeded beyond the guarantee."""

    def grow(self, alive: tuple[str, ...]) -> tuple[RunConfig, float]:
        """Configuration after a planned change to `alive` (nodes joined, or a fleet drained
        some), and its cost."""

    def commit(self) -> None:
        """The last reconfiguration finished: it becomes the base of the next one."""

    def reset(self, nodes: tuple[str, ...]) -> None:
        """After a restart: the plan on `nodes` becomes the committed one."""


class RebalanceBackend(Backend, Protocol):
    def reconfiguration_s(self, nodes: int) -> float:
        """Cost of rebalancing the redundant pipelines onto `nodes` nodes."""


class OobleckPolicy(Policy):
    name = "oobleck"

    def __init__(self, backend: InPlaceBackend, **checkpointing):
        super().__init__(**checkpointing)
        self.backend = backend
        self.lost_pending: tuple[str, ...] = ()

    def start(self, nodes: tuple[str, ...]) -> None:
        self.alive = list(nodes)
        self.backend.reset(tuple(self.alive))
        self.run = self.backend.plan(tuple(self.alive))
        self.train()

    def _fallback(self, why: str) -> None:
        self.lose_since_checkpoint()
        self.lost_pending = ()
        self.switch(self.backend.plan(tuple(self.alive)))
        self.notes.append(f"t={self.t:.0f}s: fallback to checkpoint ({why})")
        if self.run is None:  # nothing runs on the survivors: wait for nodes
            self.phase = "stopped"
            return
        self.recover("restart", self.backend.restart_s(len(self.alive)))

    def on_fail(self, node: str) -> None:
        self.alive.remove(node)
        if self.phase == "recover" and self.phase_kind == "restart":
            self.switch(self.backend.plan(tuple(self.alive)))
            self.recover("restart", self.backend.restart_s(len(self.alive)))
            return
        if self.phase == "stopped":
            return
        in_reconfig = self.phase == "recover" and self.phase_kind == "reconfiguration"
        lost = (self.lost_pending if in_reconfig else ()) + (node,)
        try:
            run, cost = self.backend.reconfigure(lost, tuple(self.alive))
        except GuaranteeExceeded as e:
            self._fallback(str(e).split(".")[0])
            return
        self.lost_pending = lost
        self.switch(run)
        self.recover("reconfiguration", cost)

    def on_add(self, node: str) -> None:
        self.alive.append(node)
        if self.phase == "stopped":
            self.backend.reset(tuple(self.alive))
            run = self.backend.plan(tuple(self.alive))
            if run is not None:
                self.switch(run)
                self.recover("restart", self.backend.restart_s(len(self.alive)))
            return
        if self.phase == "recover" and self.phase_kind == "restart":
            self.switch(self.backend.plan(tuple(self.alive)))
            return
        if self.phase == "recover":  # join after the reconfiguration in progress
            self.backend.commit()
            self.lost_pending = ()
        run, cost = self.backend.grow(tuple(self.alive))
        self.switch(run)
        self.recover("reconfiguration", cost)

    def on_recovered(self, kind: str) -> None:
        if kind == "reconfiguration":
            self.backend.commit()
        else:
            self.backend.reset(tuple(self.alive))
        self.lost_pending = ()
        self.train()

    def on_drain(self, nodes: tuple[str, ...]) -> None:
        """A fleet takes `nodes` for another job (fleet/simulate.py): a planned shrink at a
        step boundary, so the step in flight is kept and nothing is replayed; the job pays
        the planned re-plan (`grow` on fewer nodes: regroup + the layers it must receive).
        Left below its smallest plan it stops at its last checkpoint (what it trained since
        is lost) and waits for nodes; a restart in progress just takes fewer nodes."""
        for node in nodes:
            self.alive.remove(node)
        if self.phase == "stopped":
            return
        if self.backend.plan(tuple(self.alive)) is None:
            self.lose_since_checkpoint()
            self.switch(None)
            self.lost_pending = ()
            self.phase, self.after_phase = "stopped", None
            self.notes.append(f"t={self.t:.0f}s: drained below its smallest plan, waits")
            return
        if self.phase == "recover" and self.phase_kind == "restart":
            self.switch(self.backend.plan(tuple(self.alive)))
            return
        if self.phase == "recover":  # the reconfiguration in progress ends on the new plan
            self.backend.commit()
            self.lost_pending = ()
        keep = self.phase == "train"
        self.after_phase = None
        run, cost = self.backend.grow(tuple(self.alive))
        self.switch(run)
        self.recover("reconfiguration", cost, keep_step=keep)


class RestartPolicy(Policy):
    name = "restart"

    def __init__(self, backend: Backend, **checkpointing):
        super().__init__(**checkpointing)
        self.backend = backend

    def start(self, nodes: tuple[str, ...]) -> None:
        self.alive = list(nodes)
        self.run = self.backend.plan(tuple(self.alive))
        self.train()

    def _restart(self) -> None:
        self.switch(self.backend.plan(tuple(self.alive)))
        if self.run is None:
            self.lose_partial()
            self.phase = "stopped"
            return
        self.recover("restart", self.backend.restart_s(len(self.alive)))

    def on_fail(self, node: str) -> None:
        self.alive.remove(node)
        if self.phase in ("train", "checkpoint"):
            self.lose_since_checkpoint()
        self.after_phase = None
        self._restart()

    def on_add(self, node: str) -> None:
        self.alive.append(node)
        if self.phase == "recover":  # the restart in progress takes the node
            self.switch(self.backend.plan(tuple(self.alive)))
        elif self.phase == "stopped":
            self._restart()
        # while training, the node idles until the next restart (a restart costs minutes)

    def on_recovered(self, kind: str) -> None:
        self.train()


class RedundantPolicy(Policy):
    name = "redundant"

    def __init__(self, backend: RebalanceBackend, **checkpointing):
        super().__init__(**checkpointing)
        self.backend = backend
        self.exposed = False

    def start(self, nodes: tuple[str, ...]) -> None:
        self.alive = list(nodes)
        self.run = self.backend.plan(tuple(self.alive))
        self.train()

    def _restart(self) -> None:
        self.switch(self.backend.plan(tuple(self.alive)))
        if self.run is None:
            self.phase = "stopped"
            return
        self.recover("restart", self.backend.restart_s(len(self.alive)))

    def on_fail(self, node: str) -> None:
        self.alive.remove(node)
        if self.phase == "stopped":
            return
        if self.phase == "recover" and (self.phase_kind == "restart" or self.exposed):
            if self.phase_kind == "reconfiguration":  # consecutive failure: redundancy spent
                self.lose_since_checkpoint()
                self.notes.append(f"t={self.t:.0f}s: consecutive failures, fallback to checkpoint")
            self.exposed = False
            self._restart()
            return
        run = self.backend.plan(tuple(self.alive))
        if run is None:
            self.lose_since_checkpoint()
            self.switch(None)
            self.phase = "stopped"
            return
        self.switch(run)
        self.exposed = True  # until the rebalancing ends, another failure is fatal
        self.recover("reconfiguration", self.backend.reconfiguration_s(len(self.alive)),
                     keep_step=True)

    def on_add(self, node: str) -> None:
        self.alive.append(node)
        if self.phase == "stopped":
            self._restart()
        elif self.phase == "recover":  # the recovery in progress takes the node
            self.switch(self.backend.plan(tuple(self.alive)))
        # while training, the node idles until the next rebalancing (it costs minutes)

    def on_recovered(self, kind: str) -> None:
        self.exposed = False
        self.train()


POLICIES: dict[str, type[Policy]] = {"oobleck": OobleckPolicy, "restart": RestartPolicy,
                                     "redundant": RedundantPolicy, "recycle": RecyclePolicy}
"""Every policy by name; recycle (sim/recycle.py, ReCycle-like) runs on planner backends only."""
