"""The reconfigure driver: a worker's training steps, recovering in place when nodes are lost.

    driver = ElasticDriver(job, model, profile, dataset, device, client, events, faults,
                           secret=run_secret(run_dir))
    plan, comm = driver.start()          # generation 0: plan, store, groups
    driver.build_engine(state, layers)   # fresh, or from a checkpoint; then all ranks are ready
    while driver.state.engine.state.step < steps:
        result = driver.step()           # a committed step (recovers in place on failures)
    driver.finish(write_final_state)     # every rank reached the end (recovers likewise)

`step()` runs `engine.step(commit=False)`, then the commit vote (below); a failed step (a value,
never an exception: engine.py), a failed vote or a round opened by the agents turns into
`recover()`:

1. Report: `client.report_failure("comm_error", detail, suspects)` -- suspects = the node of the
   failing transfer's peer when known (the agent suspects it at once), else none (the agent
   probes every peer). Then destroy every process group of this generation at once: peers still
   blocked in a collective with this rank see their sockets close and fail within milliseconds
   instead of waiting for the collective timeout (gloo); with NCCL the communicators are aborted
   when the agent announces a round (`on_notice`, recovery/generation.py).
2. Agreement: `client.wait_membership(after_gen)` returns the generation the agents decided (see
   control/membership.py); lost = base plan's nodes missing from it. None decided within the
   agreement bound: RecoveryError (the checkpoint fallback), never a hang. Then the survivors
   settle a step whose vote was interrupted (`reconcile`, below).
3. Plan: `reconfigure(base_plan, lost, templates, profile, f)` -- pure, so every survivor computes
   the same plan; GuaranteeExceeded propagates to the caller (checkpoint fallback). Survivors
   confirm with `client.exchange` of (base plan digest, new plan digest, step, cursor): any
   difference is a hard error (never continue with a wrong model). A round that lost no node
   (the agents found every peer alive after a failed collective: a slow rank, a port clash)
   retries the step on the same plan with fresh groups, at most MAX_RETRIES times in a row;
   then RecoveryError. (Steps 2-6 are the rounds of recovery/rounds.py.)
4. Groups: the generation's store (hosted by local rank 0 of `m.store_node`, open to the run's
   own ranks only: recovery/rendezvous.py, recovery/store.py), `Comm.init`
   with the generation number, `PlanGroups.build`.
5. Transfer: a new Engine on the new plan at the same TrainState, the rank's kept layers copied
   from its base engine, the rest received from surviving replicas (recovery/transfer.py,
   weights + AdamW state).
6. Replay: the interrupted step was never committed anywhere (see below), so the new engine runs
   it again: same cursor, the same global microbatches re-split over the new pipelines
   (GlobalSampler indexes samples by global microbatch, whatever the plan), the same global
   batch size. Nothing is skipped or repeated.

Base engine. The engine whose plan committed the last step is the BASE: the authority for
layers, optimizer state and TrainState. A new engine becomes the base only when it commits its
first step; until then every failure -- during agreement, the regroup, the transfer or the
replayed step -- starts a new round from the same base, which every survivor agrees on (all
committed the same steps). The old base's layers are freed at that first commit. So a failure
during reconfiguration supersedes the round with no partial state anywhere.

Transactional step. A rank whose final all-reduce completed holds the step *prepared* (reduced,
clipped gradients; engine.step(commit=False)). It then votes over the control plane: an
exchange `commit-<step>` among the generation's nodes, which completes only once every rank of
every node sent its vote, and fails (Superseded) as soon as a membership round opens first. A
rank commits (optimizer, state advances) only when its vote completed. A failure anywhere before
that -- inside the all-reduce, between it and the vote, during the vote -- leaves the step
prepared or not at all; the survivors then settle it in `reconcile` (recovery/rounds.py), the
first exchange of the new generation: each says (base plan, committed step, cursor, plan of a prepared step). If any
survivor committed step s, the vote completed somewhere, so EVERY member had voted and holds s
prepared: the survivors still at s commit it now (roll forward; engine.commit() is local). If
none committed, every survivor drops it (roll back) and the step is replayed on the new plan. So
no survivor ever applies a step another survivor lacks, and no step is lost or applied twice. A
state that fits neither (it cannot happen under this protocol) raises RecoveryError. The vote
also carries each rank's ballot (checkpoint/resume.py: a clock-based save due, a stop signal seen), so
those decisions need no collective of their own.

Planned changes (recovery/planned.py). The vote also carries each rank's drain request and its
step's compute time; after a commit, every rank reaches the same verdict from them: nodes that
drain (control/drain.py) or a straggler excluded leave right after that commit, the others
reconfigure from it with nothing replayed; a straggler's pipeline may instead get a smaller
share of the batch, every rank switching plans in place (recovery/straggler.py).

Joins (control/membership.py, 7b). The agents open a round that only adds nodes right after a
commit vote, so it reaches every rank between two steps (or at the first wait of the next):
`rounds.admit` moves to the grown generation from the committed step like a drain does --
no failed step, nothing replayed -- while the joiners take that step's state (recovery/join.py).

Stalls (recovery/stall.py). A watchdog thread reports a wait inside a step (a transfer, a
collective, the commit vote) that lasts far longer than the usual step to the agent, which
pings the nodes waited on and suspects those that do not answer at once: a hung node is lost
in band, long before its lease expires. The wait itself goes on.

State. The driver's state is one `DriverState` (recovery/state.py): the generation, the plan and
its groups, the engine and the base engine, the recovery under way, the planned changes. The
steps are functions that take it: recovery/rounds.py (the recovery rounds), recovery/planned.py
(drains, stragglers), recovery/join.py (a spare, or a node back after a crash, joining),
recovery/generation.py (a generation's groups; a newer round noticed). `ElasticDriver` holds it
and runs the steps above.

Events (run_dir/events.jsonl, source node/local_rank): step_failed (every rank that saw it: phase,
peer, error), membership_agreed, plan_chosen, groups_rebuilt, state_transferred (bytes), and
recovered (first committed step after the recovery, with the phase times); steps numbered from
1 as everywhere the user reads them. The console shows them as oobleck_hpc/records/story.py tells them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.engine.groups import Aborted
from oobleck_hpc.errors import OobleckError
from oobleck_hpc.recovery import generation, join, rounds
from oobleck_hpc.recovery.generation import RoundOpened, on_phase, regroup, teardown
from oobleck_hpc.recovery.planned import drain, straggle
from oobleck_hpc.recovery.rounds import RecoveryError, plan_chosen, restart
from oobleck_hpc.recovery.stall import Stall, Watchdog
from oobleck_hpc.recovery.state import DriverState

if TYPE_CHECKING:
    from oobleck_hpc.engine import Comm, Engine, StepResult
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.records.events import EventLog


@dataclass(frozen=True)
class Vote:
    """A completed commit vote (`ElasticDriver._vote`), the same figures on every rank. Each
    rank sends its ballot followed by its node's drain request (control/drain.py; 0 none,
    1 asked, 2 forced), its step's forward and backward seconds and its step's seconds
    (recovery/straggler.py: every rank must decide from the same figures, its own clock differs);
    `cast` writes that layout and `counted` reads it back, nothing else does."""

    ballot: list[float]  # every rank's ballot, elementwise max
    drains: dict[str, bool]  # node asked to drain -> forced
    compute: dict[int, float]  # rank -> its step's forward and backward seconds
    seconds: float  # the step's time: the longest any rank took

    @staticmethod
    def cast(ballot: list[float], request: bool | None, compute_s: float,
             seconds: float) -> list[float]:
        """What one rank sends (`request`: its node's drain request, None when none)."""
        return ballot + [0.0 if request is None else 2.0 if request else 1.0, compute_s, seconds]

    @classmethod
    def counted(cls, values: dict[str, list[list[float]]], plan) -> Vote:
        """The vote from every rank's values (node -> one list per local rank)."""
        every = [v for per_node in values.values() for v in per_node]
        drains = {node: max(v[-3] for v in per_node) for node, per_node in values.items()}
        return cls([max(v[i] for v in every) for i in range(len(every[0]) - 3)],
                   {node: d == 2.0 for node, d in drains.items() if d},
                   {plan.rank_of(node, lr): v[-2] for node, per_node in values.items()
                    for lr, v in enumerate(per_node)},
                   max(v[-1] for v in every))


class ElasticDriver:
    """One worker's training, recovering in place (see module docstring); `state` is all of
    it (recovery/state.py)."""

    def __init__(self, job, model, profile, dataset, device: torch.device, client,
                 events: EventLog, faults=None, store_timeout_s: float = 300.0, *,
                 secret: bytes):
        self.state = DriverState(job, model, profile, dataset, device, client, events, faults,
                                 secret, store_timeout_s)
        self.watchdog = Watchdog(self.state, self._report_stall).start()

    # ------------------------------------------------------------------ generation 0

    def start(self, first_step: int = 0, failed: str | None = None) -> tuple[Plan, Comm]:
        """Generation 0: wait for the roster membership, plan, rendezvous and build the groups.
        Returns (plan, comm); then `build_engine` (a checkpoint restore goes in between).

        A node lost during the rendezvous or the restore (nothing trained yet on this run) opens
        a round like any other loss; the survivors plan afresh on the nodes they agreed on and
        rendezvous again (`failed`: why the last start's groups failed -- called again after a
        failed restore). `first_step`: the step this run starts at (fault injection only)."""
        from oobleck_hpc.planning import plan_job

        s = self.state
        if failed is None:
            m = s.client.wait_membership(timeout=s.store_timeout_s)
        else:
            m = restart(s, s.gen, RuntimeError(failed))
        while True:
            s.gen, s.view = m.gen, m.nodes
            try:
                _, s.templates, plan = plan_job(s.job, s.profile, list(m.nodes))
                s.template_nodes = len(m.nodes)
            except OobleckError as e:
                if m.gen == 0:
                    raise  # bad input: the job as submitted cannot be planned
                raise RecoveryError(f"no plan on the {len(m.nodes)} nodes left after losing "
                                    f"{', '.join(m.lost)} during the start: {e}") from e
            plan = replace(plan, generation=m.gen)
            try:
                if s.faults is not None:
                    s.faults("rendezvous", first_step + 1)
                s.comm, s.groups = regroup(s, m, plan, s.store_timeout_s)
                s.plan = plan
                if s.comm.rank == 0:
                    plan_chosen(s, plan, lost=m.lost, start=True)
                return plan, s.comm
            except (Superseded, RuntimeError, TimeoutError, ValueError) as e:
                m = restart(s, m.gen, e)

    def join(self, first_nodes: Sequence[str], after_gen: int | None = None) -> tuple[Plan, Comm]:
        """A spare's start, or a restarted node's (recovery/join.py): (plan, comm) like
        `start`, the engine built already."""
        return join.join(self.state, first_nodes, after_gen)

    def build_engine(self, state=None, layer_states=None) -> Engine:
        """The generation-0 engine (from a checkpoint's state and layers when given)."""
        from oobleck_hpc.engine import Engine

        s = self.state
        s.engine = Engine(s.job, s.model, s.plan, s.comm, s.groups, s.dataset, s.device,
                          state=state, layer_states=layer_states, on_phase=partial(on_phase, s),
                          abort=self.round_opened)
        self._start_together()
        return s.engine

    def _start_together(self) -> None:
        """Every rank of the start says it is ready to train before any runs step 1 (an
        exchange `start-<gen>`, like the commit vote). The ranks finish building (imports, model,
        restore) seconds apart on a loaded machine, and the first collective would wait for the
        last past the collective timeout: seen in CI, step 1's gradient_sync timed out 15 s
        after the groups were up, every peer alive, and a retry round followed. The wait is
        the control plane's, which a round ends at once (a collective of a group made with a
        longer timeout would also bound a dead peer's wait: 71276ee): a node lost meanwhile
        fails the first step, which recovers as any step does. Once through, the agent's
        longer start lease ends (control/topology.py)."""
        s = self.state
        try:
            s.client.exchange(f"start-{s.gen}", [], timeout=s.store_timeout_s, gen=s.gen)
        except (Superseded, TimeoutError):
            return  # step 1 sees the round (RoundOpened) or fails, and recovers
        s.client.started()

    # ------------------------------------------------------------------ steps

    def step(self, ballot: Sequence[float] = ()) -> list[StepResult]:
        """Run the next step until it commits, recovering in place on failures (raises
        GuaranteeExceeded, RecoveryError, Fenced when that is impossible). Returns the steps
        committed by this call in order: the one it ran, preceded by a step rolled forward
        during a recovery (module docstring, "Transactional step"); only the rolled step when
        it was the last.

        `ballot`: this rank's numbers for the commit vote (checkpoint/resume.py: a save due by
        the clock, a stop signal seen); their elementwise max over every rank of the vote that
        committed the step this call ran is left in `state.agreed`."""
        s = self.state
        while True:
            step = s.engine.state.step
            if step >= s.job.train.steps:
                # The step rolled forward by a recovery was the last one: nothing is left to
                # run (the ranks whose vote completed are ending the run; `finish` is the new
                # plan's first commit).
                done, s.rolled = s.rolled, []
                return done
            try:
                result = s.engine.step(commit=False)
            except RoundOpened as e:
                result, why, phase, peer = None, str(e), "round", None
            if (result is None or isinstance(result.error, Aborted)) \
                    and generation.only_joins(s):
                rounds.admit(s, step)  # a node joins at this step boundary (nothing prepared)
                continue
            if result is not None and result.ok:
                try:
                    vote = self._vote(step, list(ballot), result.compute_s, result.seconds)
                except (Superseded, TimeoutError) as e:
                    # The vote did not complete here: whether the step commits is settled
                    # among the survivors (recover -> reconcile); this engine keeps it prepared.
                    self.recover(step, "vote", repr(e), None)
                    continue
                s.engine.commit()
                self._committed()
                s.stalls.observe(vote.seconds)
                s.agreed = vote.ballot
                done, s.rolled = s.rolled + [result], []
                if vote.drains:
                    drain(s, vote.drains)
                elif s.stragglers is not None:
                    straggle(s, vote.compute, vote.seconds)
                return done
            if result is not None:
                why, phase = repr(result.error), result.phase
                # Name the peer only when its connection broke (its process died). An aborted
                # wait or a timeout says nothing about the peer: it may itself be waiting on
                # the failed node, and a false suspicion would fence a healthy node.
                peer = result.peer if _peer_died(result.error) else None
            self.recover(step, phase, why, peer)

    def recover(self, step: int, phase: str, why: str, peer: int | None) -> None:
        """Step `step` failed here (or its vote did): recover in place (recovery/rounds.py)."""
        rounds.recover(self.state, step, phase, why, peer)

    def finish(self, on_end: Callable[[], None] = lambda: None) -> None:
        """The last step committed: every rank does its part of the end (`on_end`: writing its
        final layers), then the generation agrees that all of it reached the end (an exchange
        `finish-<step>`, like the commit vote). A node lost before that -- after the last
        vote, one whose layers' final state may exist nowhere else -- is recovered from as from
        any loss (beyond the guarantee: GuaranteeExceeded, the checkpoint fallback, instead of
        a run that reports success without its final state), and the new plan's ranks end
        again."""
        s = self.state
        while True:
            step = s.engine.state.step
            on_end()
            try:
                s.client.exchange(f"finish-{step}", [], timeout=s.agree_s, gen=s.gen)
            except (Superseded, TimeoutError) as e:
                self.recover(step, "finish", repr(e), None)
                continue
            self._committed()  # the end on a new plan counts as its first commit
            return

    def _vote(self, step: int, ballot: list[float], compute_s: float = 0.0,
              seconds: float = 0.0) -> Vote:
        """The commit vote: every rank of the generation says, over the control plane, that it
        holds step `step` prepared, with its ballot, drain request and step times (`Vote`).
        Completes only when all did (then committing is safe everywhere); Superseded when a
        round opened first."""
        s = self.state
        faults = s.faults
        if faults is not None:
            faults("prepared", step + 1)
        sent = None if faults is None else (lambda: faults("vote", step + 1))
        s.voting = (time.monotonic(), step)  # (the stall watch: recovery/stall.py)
        try:
            values = s.client.exchange(
                f"commit-{step}", Vote.cast(ballot, s.client.drain_request, compute_s, seconds),
                timeout=s.agree_s, gen=s.gen, on_sent=sent)
        finally:
            s.voting = None
        return Vote.counted(values, s.plan)

    def _committed(self) -> None:
        """A step committed: the engine that committed it is the base from now on, and a
        recovery under way ends (the `recovered` event, rank 0)."""
        s = self.state
        s.retries = 0
        s.client.training()  # (once) nodes may join from now on: there is a state to take
        if s.base is not None:  # first commit on a new plan: it becomes the base
            s.base.close()
            s.base, s.base_plan = None, None
        r = s.pending
        if r is not None:
            s.pending = None
            r.t_recovered = time.time()
            r.phases["first_step"] = r.t_recovered - r.t_failed - sum(r.phases.values())
            s.recoveries.append(r)
            if s.rank == 0:
                s.events.emit("recovered", step=r.step, generation=r.generation, lost=r.lost,
                              joined=r.joined, drained=r.drained,
                              seconds=round(r.seconds, 4), rounds=r.rounds, plan=r.plan,
                              phases={k: round(v, 4) for k, v in r.phases.items()},
                              bytes_moved=r.bytes_moved)

    def _report_stall(self, stall: Stall) -> None:
        """The watchdog found this rank waiting too long inside a step (recovery/stall.py): its
        agent probes the nodes it waits on. The wait goes on."""
        self.state.client.report_failure("stall", stall.detail, stall.wait.nodes,
                                         gen=stall.wait.gen, threshold_s=stall.threshold_s)

    # ------------------------------------------------------------------ the agents' rounds

    def round_opened(self) -> bool:
        """The agents opened a membership round (or decided one) past this generation."""
        return generation.round_opened(self.state)

    def on_notice(self, kind: str, msg: dict[str, Any]) -> None:
        """The agent link's callback (AgentClient.set_notice_handler): recovery/generation.py."""
        generation.on_notice(self.state, kind, msg)

    def close(self) -> None:
        s = self.state
        self.watchdog.stop()
        for e in (s.engine, s.base):
            if e is not None:
                e.close()
        teardown(s, clean=True)
        s.store = None


def _peer_died(error: BaseException | None) -> bool:
    text = str(error)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe"))
