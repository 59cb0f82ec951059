"""In-place recovery, the rounds of recovery/driver.py's step 2-6 (see its docstring for the whole
protocol): `RecoveryRounds.recover()` runs named phases -- report, agree (and reconcile a step
left prepared), replan, regroup, transfer -- and a failure inside a round starts the next one
from the same base engine. `ElasticDriver` is a `RecoveryRounds`: the phases read and set the
driver's generation, base engine, plan and groups.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.errors import EXIT_REQUEUE, GuaranteeExceeded, OobleckError, PlanningError

MAX_RETRIES = 3
"""Consecutive generations with no node lost since the one before (the step retried in place,
or a new plan's first step failing again) before the checkpoint fallback."""
MAX_ROUNDS = 3
"""Failed reconfiguration rounds of one recovery before the checkpoint fallback (each bounded
by the agreement timeout): a recovery never loops for ever."""


@dataclass
class Joining:
    """The base of a node that a round added (a spare, membership.py step 7), until its first
    commit: the members' committed state and base plan, and no layer. Every layer it trains
    comes from the members; a failure before that first commit starts the next round from the
    members' base like theirs (this node then has nothing to give)."""

    state: Any
    plan: Any
    layers: dict = field(default_factory=dict)
    prepared: Any = None

    def release_step_memory(self) -> None:
        pass

    def close(self) -> None:
        pass


class RecoveryError(OobleckError):
    """Survivors disagree on the state to resume from: in-place recovery cannot continue."""

    exit_code = EXIT_REQUEUE  # as GuaranteeExceeded: fall back to the last checkpoint


@dataclass(frozen=True)
class Standing:
    """Where one rank stands, as it says in the reconcile exchange of a new generation
    (`_reconcile`; sent as a JSON object)."""

    base: str
    """The digest of its base plan (the plan of its last committed step)."""
    step: int
    """Steps it committed; -1 for a node joining the job (`JOINER`: it has none)."""
    cursor: int
    prepared: str
    """The digest of the plan of a step it holds prepared (its vote did not complete), or ""."""
    groups: tuple[tuple[str, ...], ...]
    """Its base plan's pipelines (their nodes), from which a joiner rebuilds that plan."""
    base_gen: int

    @classmethod
    def gathered(cls, values: dict[str, list[Any]]) -> list[Standing]:
        """The members' standings from an exchange's values (node -> one per rank): joiners,
        which have nothing to say, are left out."""
        every = [cls(**{**v, "groups": tuple(tuple(g) for g in v["groups"])})
                 for per_node in values.values() for v in per_node]
        return [x for x in every if x.step >= 0]

    @staticmethod
    def fresh(values: dict[str, list[Any]], nodes) -> frozenset[tuple[str, int]]:
        """(node, local rank) of the ranks that said JOINER on a node of `nodes` (the base
        plan's): restarted workers (control/agent.py), whose layers must come from replicas."""
        return frozenset((node, lr) for node, per_node in values.items() if node in nodes
                         for lr, v in enumerate(per_node) if v["step"] < 0)


JOINER = Standing("", -1, -1, "", (), -1)


@dataclass
class Recovery:
    """One completed in-place recovery, as this worker saw it."""

    step: int
    """The step replayed on the new plan (numbered from 1): the one that failed here, or the
    next one when the failed one was rolled forward (`_reconcile`)."""
    lost: tuple[str, ...]
    generation: int
    plan: str
    t_failed: float
    joined: tuple[str, ...] = ()
    drained: tuple[str, ...] = ()
    """Nodes that left on notice (control/drain.py): nothing failed, nothing is replayed."""
    t_recovered: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    rounds: int = 1
    bytes_moved: int = 0

    @property
    def seconds(self) -> float:
        return self.t_recovered - self.t_failed


class RecoveryRounds:
    """The recovery phases of `ElasticDriver` (module docstring)."""

    def recover(self, step: int, phase: str, why: str, peer: int | None) -> None:
        """Recover in place from a failed step (module docstring): report it, then rounds of
        agree -> replan -> regroup -> transfer until one completes (a failure inside a round
        starts the next from the same base); the new plan's first commit ends the recovery
        (`_committed`). Raises GuaranteeExceeded / RecoveryError for the checkpoint fallback."""
        rec, held = self._report(step, phase, why, peer)
        self.rounds(rec, held, why)

    def rounds(self, rec: Recovery, held, why: str) -> None:
        """Rounds of agree -> replan -> regroup -> transfer from the base engine until one
        completes (`recover`; a drain starts here, control/drain.py: nothing failed)."""
        while True:
            try:
                m = self._agree(rec, held)
                held = None
                new_plan, lost = self._replan(m, rec, why)
                self.base.release_step_memory()  # it never steps again: only its state counts
                comm, groups = self._regroup_round(m, new_plan, rec)
                engine = self._transfer(m, new_plan, comm, groups, rec)
            except Superseded:
                self._teardown()
                continue
            except (RuntimeError, TimeoutError, ValueError) as e:
                self._round_failed(rec, e)
                continue
            rec.joined = tuple(n for n in new_plan.nodes if n not in self.base_plan.nodes)
            rec.lost = tuple(sorted(set(rec.lost) | set(lost)))
            rec.generation, rec.plan = m.gen, new_plan.digest()
            self.plan, self.engine = new_plan, engine
            return

    def _report(self, step: int, phase: str, why: str, peer: int | None):
        """The step failed here: tell the run and the agent (naming the peer whose connection
        broke, if any), keep the base engine and an engine holding a prepared step (settled by
        `_reconcile`), drop this generation's groups. Returns (the recovery record, the engine
        holding a prepared step or None)."""
        suspects = []
        if peer is not None and self.plan is not None and 0 <= peer < self.plan.world_size:
            suspects = [self.plan.ranks[peer].node]
        suspects = [s for s in suspects if s != self.node]
        self.events.emit("step_failed", step=step + 1, phase=phase, peer=peer, suspects=suspects,
                         error=why[:300], generation=self.gen)
        self.client.report_failure("comm_error", f"step {step + 1} {phase}: {why[:200]}",
                                   suspects, gen=self.gen)
        if self.faults is not None:
            self.faults.on_failed_step(step + 1)
        engine, self.engine = self.engine, None
        if self.base is None:  # the current engine was the base
            self.base, self.base_plan = engine, self.plan
        held = engine if engine is not None and engine.prepared is not None else None
        if engine is not None and engine is not self.base and held is None:
            engine.close()
        self._teardown()
        if self._pending is None:
            self._pending = Recovery(step + 1, (), self.gen, "", time.time())
        else:
            self._pending.rounds += 1
        return self._pending, held

    def _agree(self, rec: Recovery, held):
        """Wait for the agents' next generation (RecoveryError when none is decided in time),
        then settle with the survivors a step `held` prepared (`_reconcile`)."""
        t0 = time.time()
        m = self._wait_membership(self.gen)
        self.gen, self.view = m.gen, m.nodes
        self._reconcile(m.gen, held)
        rec.phases["agree"] = rec.phases.get("agree", 0.0) + (time.time() - t0)
        return m

    def _replan(self, m, rec: Recovery, why: str):
        """The plan for the survivors of generation `m`: reconfigured without the nodes the base
        plan lost, or the base plan itself when none was lost (a retry in place, at most
        MAX_RETRIES in a row: also counted when a recovery's new plan fails its first step with
        no further loss, which would otherwise reconfigure from the base for ever). Returns
        (plan, lost nodes)."""
        from oobleck_hpc.planning.cost import job_profile
        from oobleck_hpc.planning.reconfigure import reconfigure

        t0 = time.time()
        lost = tuple(n for n in self.base_plan.nodes if n not in m.nodes)
        joined = tuple(n for n in m.nodes if n not in self.base_plan.nodes)
        if not m.lost and not m.joined:  # the agents' decision: the same on every survivor
            self._retries += 1
            if self._retries > MAX_RETRIES:
                raise RecoveryError(
                    f"step {self.base.state.step + 1} failed {self._retries} times in a row with "
                    f"no node lost (last: {why[:200]}); falling back to the last checkpoint")
        if self.planned is not None and self.planned[0] == (self.base_plan.digest(), lost) \
                and not joined:  # a drain's verdict computed it already (planned.py)
            new_plan = self.planned[1]
        elif lost or joined:
            try:  # the same (core-scaled) profile the templates were built from
                new_plan = reconfigure(self.base_plan, lost, self.templates,
                                       job_profile(self.job, self.profile),
                                       self.job.fault_tolerance.f, joined=joined)
            except GuaranteeExceeded as e:  # the requeued job starts on the nodes it has
                raise GuaranteeExceeded(str(e), survivors=tuple(m.nodes)) from e
            except PlanningError as e:  # no plan for these survivors: no round would find one
                raise GuaranteeExceeded(f"no plan for the {len(m.nodes)} nodes left: {e}",
                                        survivors=tuple(m.nodes)) from e
        else:
            new_plan = self.base_plan
        new_plan = replace(new_plan, generation=m.gen)
        rec.phases["plan"] = rec.phases.get("plan", 0.0) + (time.time() - t0)
        if new_plan.rank_of(self.node, self.local_rank) == 0:
            self.events.emit("membership_agreed", generation=m.gen, nodes=list(m.nodes),
                             lost=list(lost), joined=list(joined), store=m.store_addr)
            self._plan_chosen(new_plan, lost=lost, joined=joined,
                              plan_seconds=round(time.time() - t0, 4))
        return new_plan, lost

    def _regroup_round(self, m, new_plan, rec: Recovery):
        """Confirm that every survivor computed the same plan from the same state (an exchange;
        any difference is a hard error: never continue with a wrong model), then rendezvous on
        the generation's store and build the new plan's groups."""
        state = self.base.state
        mine = [self.base_plan.digest(), new_plan.digest(), state.step, state.cursor]
        values = self.client.exchange(f"recover-{m.gen}", mine, timeout=self.agree_s, gen=m.gen)
        other = [v for per_node in values.values() for v in per_node if v != mine]
        if other:
            raise RecoveryError(
                f"survivors disagree on the recovery of generation {m.gen}: this rank has (base "
                f"plan, new plan, step, cursor) = {mine}, another {other[0]}; falling back to "
                "the last checkpoint")
        if self.faults is not None:
            self.faults("reconfiguration", state.step + 1)
        if self.round_opened():  # the exchange may have completed here only
            raise Superseded(f"generation {m.gen} superseded before regrouping")
        t0 = time.time()
        comm, groups = self._regroup(m, new_plan, self.rendezvous_s)
        seconds = time.time() - t0
        rec.phases["regroup"] = rec.phases.get("regroup", 0.0) + seconds
        if comm.rank == 0:
            self.events.emit("groups_rebuilt", generation=m.gen, world=comm.world_size,
                             groups=len(groups.groups), seconds=round(seconds, 4))
        return comm, groups

    def _transfer(self, m, new_plan, comm, groups, rec: Recovery):
        """The new plan's engine: it adopts the base's modules and AdamW state for the layers
        this rank keeps (no copy), allocates the layers it receives uninitialised, and receives
        them from surviving replicas (recovery/transfer.py). Returns the engine."""
        from oobleck_hpc.recovery import transfer
        from oobleck_hpc.engine import Engine
        from oobleck_hpc.planning.reconfigure import transfer_plan

        t0 = time.time()
        info = new_plan.ranks[comm.rank]
        receive = [i for i in range(info.layer_start, info.layer_end) if i not in self.base.layers]
        engine = Engine(self.job, self.model, new_plan, comm, groups, self.dataset, self.device,
                        state=replace(self.base.state), on_phase=self._on_phase,
                        abort=self.round_opened, adopt=self.base, receive=receive)
        t1 = time.time()
        rec.phases["init"] = rec.phases.get("init", 0.0) + (t1 - t0)
        try:
            moves = transfer_plan(self.base_plan, new_plan, self.profile, self.fresh)
            if self.faults is not None:
                self.faults("transfer", self.base.state.step + 1)
            stats = transfer.execute(moves, comm.rank, self.base, engine, comm.timeout)
        except BaseException:
            engine.close()
            raise
        rec.phases["transfer"] = rec.phases.get("transfer", 0.0) + (time.time() - t1)
        rec.bytes_moved = sum(t.nbytes for t in moves)
        self.events.emit("state_transferred", generation=m.gen, rank=comm.rank,
                         sent_bytes=stats.sent_bytes, received_bytes=stats.received_bytes,
                         layers_in=stats.received_layers, layers_out=stats.sent_layers,
                         seconds=round(stats.seconds, 4), init_seconds=round(
                             rec.phases["init"], 4))
        return engine

    def _round_failed(self, rec: Recovery, error: BaseException) -> None:
        """A failure during reconfiguration of generation `self.gen`: report it and start a new
        round from the same base (module docstring); after MAX_ROUNDS, RecoveryError."""
        self.events.emit("reconfiguration_failed", generation=self.gen, error=repr(error)[:300])
        self.client.report_failure("comm_error", f"reconfiguration of generation {self.gen}: "
                                   f"{error!r}"[:300], gen=self.gen)
        self._teardown()
        rec.rounds += 1
        if rec.rounds > MAX_ROUNDS:
            raise RecoveryError(f"the recovery from step {rec.step} failed {rec.rounds} rounds "
                                f"(last: {error!r}); falling back to the last checkpoint") from error

    def _reconcile(self, gen: int, held):
        """Settle the step a failed vote left open (module docstring, "Transactional step").

        Every survivor says where it stands: (base plan digest, committed step, cursor, digest
        of the plan of a step it holds prepared or ""). The furthest committed step wins: a
        survivor one step behind that holds that very step prepared commits it now (roll
        forward; the vote completed somewhere, so every member had prepared it), a prepared
        step nobody committed is dropped (roll back). Anything else cannot be made consistent
        in place: RecoveryError. Returns the engine still holding a prepared step: None."""
        state = self.base.state
        mine = Standing(self.base_plan.digest(), state.step, state.cursor,
                        held.plan.digest() if held is not None else "",
                        tuple(tuple(p.nodes) for p in self.base_plan.pipelines),
                        self.base_plan.generation)
        values = self.client.exchange(f"reconcile-{gen}", asdict(mine), timeout=self.agree_s,
                                      gen=gen)
        every = Standing.gathered(values)
        self.fresh = Standing.fresh(values, self.base_plan.nodes)
        target = max(x.step for x in every)
        ahead = {(x.base, x.step, x.cursor) for x in every if x.step == target}
        if len(ahead) != 1:
            raise RecoveryError(f"survivors committed step {target} on different plans or "
                                f"cursors: {sorted(ahead)}; falling back to the last checkpoint")
        digest, _, cursor = ahead.pop()
        if state.step == target:
            if held is not None:
                held.rollback()
                if held is not self.base:
                    held.close()
            return None
        if not (state.step == target - 1 and held is not None and held.plan.digest() == digest
                and held.state.cursor + held.sampler.global_batch == cursor):
            raise RecoveryError(
                f"this rank stands at step {state.step} (prepared: {mine.prepared or 'none'}) while "
                f"survivors committed step {target} on plan {digest}; falling back to the last "
                "checkpoint")
        result = held.commit()
        if held is not self.base:
            self.base.close()
            self.base, self.base_plan = held, held.plan
        self._rolled.append(result)
        if self._pending is not None:  # the failed step is committed now: the next is replayed
            self._pending.step = held.state.step + 1
        self.events.emit("rolled_forward", step=result.step + 1, generation=gen,
                         plan=held.plan.digest())
        return None
