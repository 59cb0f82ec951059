"""A ReCycle-like policy (Gandhi et al., SOSP'24): no re-planning after a loss; the lost
node's micro-batches go to its data-parallel peers, the nodes of the other pipelines that hold
the same stage, and fill their pipeline bubbles. Beside oobleck's re-instantiation, so which
of the two a job should use after a loss is decided by numbers (`simulate JOB.yaml --policies
oobleck,recycle`).

Model (planner-driven, RecycleBackend): the job runs p copies of one template of t nodes (the
best homogeneous plan with at least f + 1 pipelines where the nodes allow it,
PlannerModel.homogeneous: ReCycle's peers must hold identical stages;
node i of the start order is stage i mod t of pipeline i div t; nodes past p x t idle). A
1F1B step of m = M/p micro-batches per pipeline takes m + t - 1 slots, t - 1 of them bubble.
When k_s nodes of stage s are lost, each of the p - k_s surviving peers of that stage runs
k_s x m / (p - k_s) more micro-batches; the bubble absorbs up to t - 1 of them for free (an
upper bound on ReCycle: its decoupled backward and staggered optimizer are assumed to fill the
whole bubble), so

    iteration = iteration_0 x (m + t - 1 + max_s max(0, k_s m / (p - k_s) - (t - 1))) / (m + t - 1)

A loss costs detection + regroup (the peers re-route; nothing is copied) and the step in flight
is replayed. A stage with no peer left (k_s = p) exceeds what ReCycle can absorb: the job falls
back to its checkpoint and restarts on a fresh homogeneous plan of the survivors. A joining node
takes the place of a lost one (it receives that stage's layers); when no stage is short it
idles until the next restart (ReCycle re-plans only offline). Checkpoints are asynchronous as
oobleck's, at Young/Daly's interval for every failure (planner_backend.checkpoint_settings):
a loss at a stage whose every peer is gone needs them, and with few pipelines that is common.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oobleck_hpc.errors import GuaranteeExceeded
from oobleck_hpc.sim.engine import Policy, RunConfig

if TYPE_CHECKING:
    from oobleck_hpc.sim.planner_backend import PlannerModel


class RecycleBackend:
    """The homogeneous plan of the last (re)start, and the losses it absorbed since."""

    def __init__(self, model: PlannerModel):
        self.m = model
        self.stage_of: dict[str, int] = {}
        self.lost: dict[int, int] = {}
        self.shape: tuple[float, int, int] | None = None  # (iteration_s, t, p)

    def _pipelines(self, n: int) -> int:
        """f + 1 pipelines (a peer for every stage after f losses) where n nodes allow it."""
        want = self.m.job.fault_tolerance.f + 1
        return want if self.m.homogeneous_shape(n, want) is not None else 1

    def plan(self, nodes: tuple[str, ...]) -> RunConfig | None:
        return self.m.homogeneous(len(nodes), self._pipelines(len(nodes)))

    def reset(self, nodes: tuple[str, ...]) -> None:
        """A (re)start on `nodes`: their stages, no loss yet."""
        self.shape = self.m.homogeneous_shape(len(nodes), self._pipelines(len(nodes)))
        self.lost = {}
        self.stage_of = {}
        if self.shape is not None:
            _, t, p = self.shape
            self.stage_of = {node: i % t for i, node in enumerate(nodes[:t * p])}

    def uses(self, node: str) -> bool:
        return node in self.stage_of

    def reroute(self, node: str) -> tuple[RunConfig, float]:
        """`node` is lost: its peers take its micro-batches (module docstring)."""
        assert self.shape is not None
        it0, t, p = self.shape
        stage = self.stage_of.pop(node)
        self.lost[stage] = self.lost.get(stage, 0) + 1
        if self.lost[stage] >= p:
            raise GuaranteeExceeded(f"stage {stage} has no data-parallel peer left.")
        return self._run(), self.m.detect_s + self.m.params.regroup_s

    def refill(self, node: str) -> tuple[RunConfig, float] | None:
        """A node joins: it takes the place of a lost one (the first stage short of a node),
        receiving that stage's layers (regroup + one stage's state over the inter-node link);
        None when no stage is short (it idles until the next restart)."""
        short = sorted(s for s, k in self.lost.items() if k > 0)
        if not short or self.shape is None:
            return None
        self.lost[short[0]] -= 1
        self.stage_of[node] = short[0]
        stage_bytes = self.m.state_bytes / self.shape[1]
        return self._run(), (self.m.params.regroup_s
                             + self.m.profile.machine.p2p_inter.time_ms(stage_bytes) / 1000.0)

    def _run(self) -> RunConfig:
        assert self.shape is not None
        it0, t, p = self.shape
        m = self.m.job.train.global_microbatches / p
        slots = m + t - 1
        extra = max((max(0.0, k * m / (p - k) - (t - 1)) for k in self.lost.values()),
                    default=0.0)
        return RunConfig(it0 * (slots + extra) / slots, self.m.samples, len(self.stage_of), 1.0,
                         f"{p}x{t} nodes, {sum(self.lost.values())} lost re-routed")

    def restart_s(self, nodes: int) -> float:
        return self.m.restart_s()


class RecyclePolicy(Policy):
    name = "recycle"

    def __init__(self, backend: RecycleBackend, **checkpointing):
        super().__init__(**checkpointing)
        self.backend = backend

    def start(self, nodes: tuple[str, ...]) -> None:
        self.alive = list(nodes)
        self.backend.reset(nodes)
        self.run = self.backend.plan(nodes)
        self.train()

    def _restart(self) -> None:
        self.switch(self.backend.plan(tuple(self.alive)))
        if self.run is None:
            self.phase = "stopped"
            return
        self.recover("restart", self.backend.restart_s(len(self.alive)))

    def on_fail(self, node: str) -> None:
        self.alive.remove(node)
        if self.phase == "stopped" or (self.phase == "recover" and self.phase_kind == "restart"):
            if self.phase != "stopped":
                self._restart()
            return
        if not self.backend.uses(node):  # an idle node: nothing to re-route
            return
        try:
            run, cost = self.backend.reroute(node)
        except GuaranteeExceeded as e:
            self.lose_since_checkpoint()
            self.notes.append(f"t={self.t:.0f}s: fallback to checkpoint ({e})")
            self.after_phase = None
            self._restart()
            return
        self.switch(run)
        self.recover("reconfiguration", cost)

    def on_add(self, node: str) -> None:
        self.alive.append(node)
        if self.phase == "stopped":
            self._restart()
        elif self.phase == "recover" and self.phase_kind == "restart":
            self.switch(self.backend.plan(tuple(self.alive)))
        elif (refill := self.backend.refill(node)) is not None:
            self.switch(refill[0])
            self.recover("reconfiguration", refill[1])
        # otherwise it idles until the next restart

    def on_recovered(self, kind: str) -> None:
        if kind == "restart":
            self.backend.reset(tuple(self.alive))
        self.train()
