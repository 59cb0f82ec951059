"""The elastic driver's state, in one typed object: what a worker's recovery steps
(recovery/rounds.py), planned changes (recovery/planned.py), joins (recovery/join.py) and
generation handling (recovery/generation.py) read and change. Each of them takes this object as
its first argument; nothing is shared through a class's attributes. `ElasticDriver`
(recovery/driver.py) holds one and tells the protocol (its docstring).

The first fields are the worker's fixed inputs, the rest what a generation, a step or a
recovery leaves behind. The base engine (driver.py docstring, "Base engine"): the engine of the
last committed step while a recovery or a plan switch is under way, else None (then `engine` is
the base).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oobleck_hpc.recovery.stall import StallWatch
from oobleck_hpc.recovery.straggler import Tracker

if TYPE_CHECKING:
    import torch

    from oobleck_hpc.config import JobConfig
    from oobleck_hpc.control.client import AgentClient
    from oobleck_hpc.control.drain import Verdict
    from oobleck_hpc.control.faults import FaultInjector
    from oobleck_hpc.data.dataset import TokenDataset
    from oobleck_hpc.engine import Comm, Engine, PlanGroups, StepResult
    from oobleck_hpc.models.interface import LayerModel
    from oobleck_hpc.planning.plan import Plan, Template
    from oobleck_hpc.profiling.profile import ModelProfile
    from oobleck_hpc.records.events import EventLog
    from oobleck_hpc.recovery.join import Joining
    from oobleck_hpc.recovery.rounds import Recovery
    from oobleck_hpc.recovery.store import AuthStore
    from oobleck_hpc.recovery.straggler import Choice


@dataclass(eq=False)
class DriverState:
    """One worker's elastic training state (module docstring)."""

    # ---------------------------------------------------------------- fixed inputs
    job: JobConfig
    model: LayerModel
    profile: ModelProfile
    """The profile the templates were built from (planning: `job_profile(job, profile)`)."""
    dataset: TokenDataset
    device: torch.device
    client: AgentClient
    """The link to this node's agent: membership, exchanges (the votes), failure reports."""
    events: EventLog
    faults: FaultInjector | None
    """Injected failures (tests, chaos); None in a real run."""
    secret: bytes
    """The run's secret (control/auth.py): what opens every generation's store."""
    store_timeout_s: float = 300.0
    """How long generation 0 waits for its roster and every rank's arrival at the store."""

    # ---------------------------------------------------------------- the generation
    gen: int = -1
    """The generation this rank works in (the agents' decision; -1 before the first)."""
    view: tuple[str, ...] = ()
    """Generation `gen`'s decided nodes, in the agents' order (their quorum rule reads it)."""
    templates: dict[int, Template] | None = None
    """Pipeline templates by node count, built once for the nodes of the generation that
    started (`template_nodes` of them: a start that lost nodes builds them again)."""
    template_nodes: int = 0
    plan: Plan | None = None
    """The plan `engine` trains on."""
    comm: Comm | None = None
    """This generation's communicator (None once torn down)."""
    groups: PlanGroups | None = None
    """The plan's process groups on `comm`."""
    store: AuthStore | None = None
    """This generation's rendezvous store (recovery/rendezvous.py)."""
    store_at: tuple[int, str, int] | None = None
    """(generation, host, port) of the store this rank is a client of (None: it hosts it)."""

    # ---------------------------------------------------------------- engines and steps
    engine: Engine | None = None
    """The engine that runs the next step (None between a failure and the round's end)."""
    base: Engine | Joining | None = None
    """The engine of the last committed step while it is not `engine` (module docstring)."""
    base_plan: Plan | None = None
    """`base`'s plan."""
    rolled: list[StepResult] = field(default_factory=list)
    """Steps committed by roll-forward during a recovery, not yet returned by step()."""
    agreed: list[float] | None = None
    """The elementwise max of every rank's ballot in the vote that committed the last step."""
    voting: tuple[float, int] | None = None
    """(time.monotonic() when it began, step) while this rank waits for a commit vote."""
    stalls: StallWatch = field(default_factory=StallWatch)
    """The usual step time and the stalls reported (recovery/stall.py)."""

    # ---------------------------------------------------------------- recoveries
    pending: Recovery | None = None
    """The recovery under way, until the new plan's first commit."""
    recoveries: list[Recovery] = field(default_factory=list)
    """Completed recoveries, in order."""
    retries: int = 0
    """Generations in a row with no node lost (rounds.MAX_RETRIES)."""
    fresh: frozenset[tuple[str, int]] = frozenset()
    """Ranks of the base plan that restarted without their state (Standing.fresh), from the
    last reconcile exchange: the transfer sends them their layers."""

    # ---------------------------------------------------------------- planned changes
    planned: tuple[tuple[str, tuple[str, ...]], Plan] | None = None
    """((base plan digest, nodes leaving), the plan without them) of a planned leave."""
    stop_for: Verdict | None = None
    """A forced drain refused (control/drain.Verdict): train.py stops the job with a checkpoint
    of the step just committed, for a requeue without the leaving nodes."""
    stragglers: Tracker | None = field(init=False)
    """Each node's slowdown over the last steps (None: fault_tolerance.straggler is "none")."""
    step_s: collections.deque[float] = field(init=False)
    """This rank's last step times (the straggler_measured event)."""
    watching: tuple[Choice, float] | None = None
    """(the last straggler action, the median step time before it) until measured after."""
    tracked: str = ""
    """The digest of the plan the straggler windows are measured against."""

    def __post_init__(self) -> None:
        ft = self.job.fault_tolerance
        self.stragglers = None if ft.straggler == "none" else Tracker(
            ft.straggler_ratio, ft.straggler_steps, ft.straggler_window_s)
        self.step_s = collections.deque(maxlen=ft.straggler_steps)

    @property
    def node(self) -> str:
        return self.client.node

    @property
    def local_rank(self) -> int:
        return self.client.local_rank

    @property
    def timeout_s(self) -> float:
        """A collective's timeout."""
        return self.job.fault_tolerance.collective_timeout_s

    @property
    def rendezvous_s(self) -> float:
        """A recovery's rendezvous bound: survivors may still be blocked in an old collective
        for up to the collective timeout when a new generation is decided; it waits longer."""
        ft = self.job.fault_tolerance
        return 2 * ft.collective_timeout_s + ft.lease_s + 5.0

    @property
    def agree_s(self) -> float:
        """The agreement bound: a membership decision, a vote, an exchange."""
        ft = self.job.fault_tolerance
        return 4 * ft.lease_s + 2 * ft.collective_timeout_s + 30.0

    @property
    def rank(self) -> int:
        """This rank in the current generation's plan."""
        return self.comm.rank
