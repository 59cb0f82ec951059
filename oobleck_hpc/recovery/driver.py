"""The reconfigure driver: a worker's training steps, recovering in place when nodes are lost.

    driver = ElasticDriver(job, model, profile, dataset, device, client, events, faults,
                           secret=run_secret(run_dir))
    plan, comm = driver.start()          # generation 0: plan, store, groups
    driver.build_engine(state, layers)   # fresh, or from a checkpoint
    while driver.engine.state.step < steps:
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
   when the agent announces a round (`_on_notice`).
2. Agreement: `client.wait_membership(after_gen)` returns the generation the agents decided (see
   control/membership.py); lost = base plan's nodes missing from it. None decided within the
   agreement bound: RecoveryError (the checkpoint fallback), never a hang. Then the survivors
   settle a step whose vote was interrupted (`_reconcile`, below).
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
prepared or not at all; the survivors then settle it in `_reconcile`, the first exchange of the
new generation: each says (base plan, committed step, cursor, plan of a prepared step). If any
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

Events (run_dir/events.jsonl, source node/local_rank): step_failed (every rank that saw it: phase,
peer, error), membership_agreed, plan_chosen, groups_rebuilt, state_transferred (bytes), and
recovered (first committed step after the recovery, with the phase times); steps numbered from
1 as everywhere the user reads them. The console shows them as oobleck_hpc/records/story.py tells them.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from oobleck_hpc.records.events import EventLog
from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.recovery.rounds import (JOINER, Joining, Recovery, RecoveryError, RecoveryRounds,
                                          Standing)
from oobleck_hpc.recovery.planned import Drained, PlannedChanges
from oobleck_hpc.recovery.straggler import Tracker
from oobleck_hpc.recovery.rendezvous import open_store, release_connections, wait_arrivals
from oobleck_hpc.errors import OobleckError

if TYPE_CHECKING:
    from oobleck_hpc.engine.state import StepResult

class RoundOpened(Exception):
    """Raised from the engine's on_phase hook when the agents opened a membership round."""


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


class ElasticDriver(RecoveryRounds, PlannedChanges):
    """One worker's training, recovering in place (see module docstring)."""

    def __init__(self, job, model, profile, dataset, device: torch.device, client, events: EventLog,
                 faults=None, store_timeout_s: float = 300.0, *, secret: bytes):
        self.job, self.model, self.profile, self.dataset = job, model, profile, dataset
        self.secret = secret
        """The run's secret (control/auth.py): what opens every generation's store."""
        self.device, self.client, self.events, self.faults = device, client, events, faults
        self.node, self.local_rank = client.node, client.local_rank
        ft = job.fault_tolerance
        self.timeout_s = ft.collective_timeout_s
        # Survivors may still be blocked in an old collective for up to the collective timeout
        # when a new generation is decided; the rendezvous waits longer than that.
        self.rendezvous_s = 2 * ft.collective_timeout_s + ft.lease_s + 5.0
        self.agree_s = 4 * ft.lease_s + 2 * ft.collective_timeout_s + 30.0
        self.store_timeout_s = store_timeout_s
        self.gen = -1
        self.view: tuple[str, ...] = ()
        """Generation `gen`'s decided nodes, in the agents' order (their quorum rule reads it)."""
        self.plan = None
        self.templates = None
        self.comm = None
        self.store = None
        self._store_at: tuple[int, str, int] | None = None
        """(generation, host, port) of the store this rank is a client of (None: it hosts it)."""
        self.engine = None
        self.base = None
        """The engine of the last committed step (module docstring); None while it is `engine`."""
        self.base_plan = None
        self.recoveries: list[Recovery] = []
        self.fresh: frozenset[tuple[str, int]] = frozenset()
        """Ranks of the base plan that restarted without their state (Standing.fresh), from
        the last reconcile exchange: the transfer sends them their layers."""
        self._pending: Recovery | None = None
        self._rolled: list = []
        """Steps committed by roll-forward during a recovery, not yet returned by step()."""
        self._retries = 0
        self.agreed: list[float] | None = None
        self.stragglers = None if ft.straggler == "none" else Tracker(
            ft.straggler_ratio, ft.straggler_steps, ft.straggler_window_s)
        self._step_s: collections.deque[float] = collections.deque(maxlen=ft.straggler_steps)
        """This rank's last step times (the straggler_measured event)."""
        self._watching = None
        """(the last straggler action, the median step time before it) until measured after."""
        self._tracked = ""
        """The digest of the plan the straggler windows are measured against."""
        self.planned = None
        """((base plan digest, nodes leaving), the plan without them) of a planned leave."""
        self.stop_for = None
        """A forced drain refused (control/drain.Verdict): train.py stops the job with a
        checkpoint of the step just committed, for a requeue without the leaving nodes."""

    # ------------------------------------------------------------------ generation 0

    def start(self, first_step: int = 0, failed: str | None = None):
        """Generation 0: wait for the roster membership, plan, rendezvous and build the groups.
        Returns (plan, comm); then `build_engine` (a checkpoint restore goes in between).

        A node lost during the rendezvous or the restore (nothing trained yet on this run) opens
        a round like any other loss; the survivors plan afresh on the nodes they agreed on and
        rendezvous again (`failed`: why the last start's groups failed -- called again after a
        failed restore). `first_step`: the step this run starts at (fault injection only)."""
        from oobleck_hpc.planning import plan_job

        if failed is None:
            m = self.client.wait_membership(timeout=self.store_timeout_s)
        else:
            m = self._restart(self.gen, RuntimeError(failed))
        while True:
            self.gen, self.view = m.gen, m.nodes
            try:
                _, self.templates, plan = plan_job(self.job, self.profile, list(m.nodes))
            except OobleckError as e:
                if m.gen == 0:
                    raise  # bad input: the job as submitted cannot be planned
                raise RecoveryError(f"no plan on the {len(m.nodes)} nodes left after losing "
                                    f"{', '.join(m.lost)} during the start: {e}") from e
            plan = replace(plan, generation=m.gen)
            try:
                if self.faults is not None:
                    self.faults("rendezvous", first_step + 1)
                self.comm, self._groups = self._regroup(m, plan, self.store_timeout_s)
                self.plan = plan
                if self.comm.rank == 0:
                    self._plan_chosen(plan, lost=m.lost, start=True)
                return plan, self.comm
            except (Superseded, RuntimeError, TimeoutError, ValueError) as e:
                m = self._restart(m.gen, e)

    def join(self, first_nodes: Sequence[str], after_gen: int | None = None):
        """A spare's start (membership.py, step 7): wait -- for the whole run if no loss needs
        this node -- until a round swaps it in, then take part in that round's recovery like a
        survivor with nothing to give: learn the members' committed state and base plan (the
        reconcile exchange), compute the same new plan, rendezvous, receive every layer of this
        rank (weights and AdamW state) from the members. The engine it builds holds exactly the
        members' committed state; the round's replayed step is this node's first. Returns
        (plan, comm) like `start`. `first_nodes`: generation 0's nodes (the templates' size).

        A worker restarted in place after a crash (control/agent.py) starts here too, with `after_gen`:
        the generation its predecessor worked in; it joins the next one (the retry round its
        agent opened, or whatever round came first) as the same rank of a node that stays,
        and its layers come from their replicas (Standing.fresh)."""
        from oobleck_hpc.planning import plan_job

        # What an engine's first build costs once per process, paid now instead of during the
        # swap: the optimizer's first construction imports torch._dynamo (~1 s on a 2-core
        # machine, measured: the whole of a joiner's engine init).
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        _, self.templates, _ = plan_job(self.job, self.profile, list(first_nodes))
        m = self.client.wait_membership(after_gen=-1 if after_gen is None else after_gen)
        t_told = time.time()
        while True:
            self.gen, self.view = m.gen, m.nodes
            rec = Recovery(0, (), m.gen, "", t_told)
            try:
                self.base = self._joining_base(m.gen)
                self.base_plan = self.base.plan
                rec.step = self.base.state.step + 1
                new_plan, lost = self._replan(m, rec, "join")
                comm, groups = self._regroup_round(m, new_plan, rec)
                engine = self._transfer(m, new_plan, comm, groups, rec)
                # (as the members' record of the round: the joiner may be rank 0, the teller)
                rec.joined = tuple(n for n in new_plan.nodes if n not in self.base_plan.nodes)
                rec.lost, rec.plan = tuple(sorted(lost)), new_plan.digest()
            except (Superseded, RuntimeError, TimeoutError, ValueError) as e:
                m = self._restart(m.gen, e)
                continue
            self.plan, self.engine, self.comm = new_plan, engine, comm
            self._pending = rec
            self.events.emit("node_joined" if after_gen is None else "worker_rejoined",
                             node=self.node, generation=m.gen, step=rec.step,
                             seconds=round(time.time() - t_told, 4), phases={
                                 k: round(v, 4) for k, v in rec.phases.items()},
                             received_bytes=rec.bytes_moved if self.local_rank == 0 else None)
            return new_plan, comm

    def _joining_base(self, gen: int):
        """The members' committed state and base plan, from generation `gen`'s reconcile
        exchange (a joiner says step -1: the members leave it out)."""
        from oobleck_hpc.engine import TrainState
        from oobleck_hpc.planning.cost import job_profile
        from oobleck_hpc.planning.reconfigure import plan_from_groups

        values = self.client.exchange(f"reconcile-{gen}", asdict(JOINER), timeout=self.agree_s,
                                      gen=gen)
        members = Standing.gathered(values)
        step = max(x.step for x in members)
        ahead = {(x.base, x.cursor, x.groups, x.base_gen) for x in members if x.step == step}
        if len(ahead) != 1:
            raise RecoveryError(f"the members of generation {gen} committed step {step} on "
                                f"different plans or cursors: {sorted(ahead)}")
        digest, cursor, groups, base_gen = ahead.pop()
        plan = plan_from_groups([list(g) for g in groups], self.templates,
                                 self.job.train.global_microbatches,
                                 job_profile(self.job, self.profile), base_gen)
        if plan is None or plan.digest() != digest:
            raise RecoveryError(f"this joining node rebuilt the members' base plan as "
                                f"{plan.digest() if plan else None}, they have {digest}")
        self.fresh = Standing.fresh(values, plan.nodes)
        return Joining(TrainState(step=step, cursor=cursor), plan)

    def _restart(self, gen: int, error: BaseException):
        """The start on generation `gen` failed: report it (unless a round is already what
        stopped it), drop the groups, and wait for the next generation."""
        self.events.emit("rendezvous_failed", generation=gen, error=repr(error)[:300])
        if not isinstance(error, Superseded):
            self.client.report_failure("comm_error", f"start on generation {gen}: "
                                       f"{error!r}"[:300], gen=gen)
        self._teardown()
        return self._wait_membership(gen)

    def build_engine(self, state=None, layer_states=None):
        """The generation-0 engine (from a checkpoint's state and layers when given)."""
        from oobleck_hpc.engine import Engine

        self.engine = Engine(self.job, self.model, self.plan, self.comm, self._groups,
                             self.dataset, self.device, state=state, layer_states=layer_states,
                             on_phase=self._on_phase, abort=self.round_opened)
        return self.engine

    @property
    def rank(self) -> int:
        return self.comm.rank

    # ------------------------------------------------------------------ steps

    def step(self, ballot: Sequence[float] = ()) -> list[StepResult]:
        """Run the next step until it commits, recovering in place on failures (raises
        GuaranteeExceeded, RecoveryError, Fenced when that is impossible). Returns the steps
        committed by this call in order: the one it ran, preceded by a step rolled forward
        during a recovery (module docstring, "Transactional step"); only the rolled step when
        it was the last.

        `ballot`: this rank's numbers for the commit vote (checkpoint/resume.py: a save due by the clock,
        a stop signal seen); their elementwise max over every rank of the vote that committed
        the step this call ran is left in `self.agreed`."""
        while True:
            step = self.engine.state.step
            if step >= self.job.train.steps:
                # The step rolled forward by a recovery was the last one: nothing is left to
                # run (the ranks whose vote completed are ending the run; `finish` is the new
                # plan's first commit).
                done, self._rolled = self._rolled, []
                return done
            try:
                result = self.engine.step(commit=False)
            except RoundOpened as e:
                result, why, phase, peer = None, str(e), "round", None
            if result is not None and result.ok:
                try:
                    vote = self._vote(step, list(ballot), result.compute_s, result.seconds)
                except (Superseded, TimeoutError) as e:
                    # The vote did not complete here: whether the step commits is settled
                    # among the survivors (recover -> _reconcile); this engine keeps it prepared.
                    self.recover(step, "vote", repr(e), None)
                    continue
                self.engine.commit()
                self._committed()
                self.agreed = vote.ballot
                done, self._rolled = self._rolled + [result], []
                if vote.drains:
                    self._drain(vote.drains)
                elif self.stragglers is not None:
                    self._straggle(vote.compute, vote.seconds)
                return done
            if result is not None:
                why, phase = repr(result.error), result.phase
                # Name the peer only when its connection broke (its process died). An aborted
                # wait or a timeout says nothing about the peer: it may itself be waiting on
                # the failed node, and a false suspicion would fence a healthy node.
                peer = result.peer if _peer_died(result.error) else None
            self.recover(step, phase, why, peer)

    def finish(self, on_end: Callable[[], None] = lambda: None) -> None:
        """The last step committed: every rank does its part of the end (`on_end`: writing its
        final layers), then the generation agrees that all of it reached the end (an exchange
        `finish-<step>`, like the commit vote). A node lost before that -- after the last
        vote, one whose layers' final state may exist nowhere else -- is recovered from as from
        any loss (beyond the guarantee: GuaranteeExceeded, the checkpoint fallback, instead of
        a run that reports success without its final state), and the new plan's ranks end
        again."""
        while True:
            step = self.engine.state.step
            on_end()
            try:
                self.client.exchange(f"finish-{step}", [], timeout=self.agree_s, gen=self.gen)
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
        if self.faults is not None:
            self.faults("prepared", step + 1)
        sent = None if self.faults is None else (lambda: self.faults("vote", step + 1))
        values = self.client.exchange(
            f"commit-{step}", Vote.cast(ballot, self.client.drain_request, compute_s, seconds),
            timeout=self.agree_s, gen=self.gen, on_sent=sent)
        return Vote.counted(values, self.plan)

    def _committed(self) -> None:
        self._retries = 0
        self.client.training()  # (once) nodes may join from now on: there is a state to take
        if self.base is not None:  # first commit on a new plan: it becomes the base
            self.base.close()
            self.base, self.base_plan = None, None
        r = self._pending
        if r is not None:
            self._pending = None
            r.t_recovered = time.time()
            r.phases["first_step"] = r.t_recovered - r.t_failed - sum(r.phases.values())
            self.recoveries.append(r)
            if self.rank == 0:
                self.events.emit("recovered", step=r.step, generation=r.generation, lost=r.lost,
                                 joined=r.joined, drained=r.drained,
                                 seconds=round(r.seconds, 4), rounds=r.rounds, plan=r.plan,
                                 phases={k: round(v, 4) for k, v in r.phases.items()},
                                 bytes_moved=r.bytes_moved)

    def _plan_chosen(self, plan, **fields) -> None:
        """The `plan_chosen` event (rank 0 of the plan): what the console and the report show."""
        from oobleck_hpc.planning.cost import job_profile, predicted_step_ms, sharing_note

        self.events.emit("plan_chosen", generation=plan.generation, plan=plan.digest(),
                         pipelines=[p.template.num_nodes for p in plan.pipelines],
                         microbatches=[p.microbatches for p in plan.pipelines],
                         nodes=len(plan.nodes), gpus_per_node=plan.gpus_per_node,
                         predicted_step_ms=round(predicted_step_ms(
                             plan, job_profile(self.job, self.profile)), 3),
                         note=sharing_note(self.job, self.profile), layout=plan.layout(),
                         **fields)

    def round_opened(self) -> bool:
        """The agents opened a membership round (or decided one) past this generation."""
        r = self.client.round_open
        m = self.client.membership
        return (r is not None and r["gen"] > self.gen) or (m is not None and m.gen > self.gen)

    def _on_phase(self, phase: str, step: int) -> None:
        if self.faults is not None:
            self.faults(phase, step + 1)  # the engine's step index; faults count from 1
        if phase not in ("optimizer", "commit") and self.round_opened():
            # past the vote a step commits whatever happens (module docstring)
            r = self.client.round_open
            raise RoundOpened(f"membership round opened (suspects: "
                              f"{r['suspects'] if r else 'decided'})")

    def _wait_membership(self, after_gen: int):
        """The next decided generation; no decision within the agreement bound is a dead end
        for in-place recovery, so the checkpoint fallback takes over (RecoveryError)."""
        try:
            return self.client.wait_membership(after_gen=after_gen, timeout=self.agree_s)
        except TimeoutError as e:
            raise RecoveryError(f"no membership decided after generation {after_gen} within "
                                f"{self.agree_s:.0f} s ({e}); falling back to the last "
                                "checkpoint") from e

    # ------------------------------------------------------------------ groups

    def _regroup(self, m, plan, timeout_s: float):
        """Rendezvous on generation `m.gen`'s store and build the plan's groups.

        Every rank first waits, up to `timeout_s`, until all ranks of the plan reached the store
        (Superseded as soon as a newer round opens). torch bounds a process group's rendezvous by
        the collective timeout, short on purpose; without this wait, ranks arriving seconds apart
        time out: at generation 0 those still importing torch on a loaded machine, later a
        survivor still stuck for a collective timeout in the previous, failed rendezvous while
        the others already started the next one (each then gives up on the other). A rank that
        died instead never arrives; its loss opens a newer round, which ends the wait at once.
        """
        from oobleck_hpc.engine import Comm, PlanGroups, default_backend
        from oobleck_hpc.engine.tied import tied_layers

        rank = plan.rank_of(self.node, self.local_rank)
        host = self.client.hosts_store(m)
        old = self.store
        self.store = open_store(m.store_host, m.store_port, host, timeout_s, self.round_opened,
                                secret=self.secret, generation=m.gen)
        self._store_at = None if host else (m.gen, m.store_host, m.store_port)
        del old
        wait_arrivals(self.store, "arrived", plan.world_size, timeout_s, self.round_opened)
        comm = Comm.init(self.store, rank, plan.world_size, m.gen,
                         default_backend(self.device.type), self.timeout_s,
                         device=self.device, init_timeout_s=timeout_s)
        self.comm = comm
        try:
            groups = PlanGroups.build(plan, comm, tied_layers(self.model))
        except BaseException:
            self._teardown()
            raise
        return comm, groups

    def _teardown(self, clean: bool = False) -> None:
        """Drop this generation's groups: after a failure without waiting for the collectives
        still in flight (Comm.abandon), at the end of the run cleanly (Comm.destroy)."""
        if self.comm is not None:
            try:
                if clean:
                    self.comm.destroy()
                else:
                    self.comm.abandon()
            except Exception as e:  # a broken group still goes away
                print(f"[{self.node}/{self.local_rank}] destroying generation {self.gen}: {e!r}",
                      file=sys.stderr, flush=True)
            self.comm = None

    def on_notice(self, kind: str, msg: dict[str, Any]) -> None:
        """AgentClient callback (on the agent link's thread) when a round opens: shut down the
        connection to an older generation's store (a store op waiting on a frozen host would
        never return: `release_connections`), and abort this generation's NCCL communicators
        (`Comm.abort`: pending collectives fail at once; idempotent, and harmless when the
        groups are already gone); gloo relies on the engine's abortable waits and on failed
        peers dropping their groups."""
        at = self._store_at
        if kind == "round" and at is not None and at[0] < msg.get("gen", 0):
            release_connections(at[1], at[2])
        comm = self.comm  # read once: the training thread may drop it meanwhile
        if kind == "round" and comm is not None and comm.generation < msg.get("gen", 0):
            comm.abort()

    def close(self) -> None:
        for e in (self.engine, self.base):
            if e is not None:
                e.close()
        self._teardown(clean=True)
        self.store = None


def _peer_died(error: BaseException | None) -> bool:
    text = str(error)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                   "Broken pipe"))


__all__ = ["Drained", "ElasticDriver", "Recovery", "RecoveryError", "RoundOpened",
           "release_connections"]
