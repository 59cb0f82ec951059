"""In-place recovery, the rounds of recovery/driver.py's step 2-6 (see its docstring for the whole
protocol): `recover()` runs named phases -- report, agree (and reconcile a step left prepared),
replan, regroup, transfer -- and a failure inside a round starts the next one from the same base
engine. Each phase is a function of the driver's state (recovery/state.py): it reads and sets
the generation, base engine, plan and groups there.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.errors import GuaranteeExceeded, PlanningError, RecoveryError
from oobleck_hpc.recovery.generation import on_phase, regroup, round_opened, teardown
from oobleck_hpc.recovery.stall import watched
from oobleck_hpc.recovery.standing import Standing

if TYPE_CHECKING:
    from oobleck_hpc.control.client import Membership
    from oobleck_hpc.engine import Comm, Engine, PlanGroups
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.recovery.state import DriverState

MAX_RETRIES = 3
"""Consecutive generations with no node lost since the one before (the step retried in place,
or a new plan's first step failing again) before the checkpoint fallback."""
MAX_ROUNDS = 3
"""Failed reconfiguration rounds of one recovery before the checkpoint fallback (each bounded
by the agreement timeout): a recovery never loops for ever."""


@dataclass
class Recovery:
    """One completed in-place recovery, as this worker saw it."""

    step: int
    """The step replayed on the new plan (numbered from 1): the one that failed here, or the
    next one when the failed one was rolled forward (`reconcile`)."""
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


def recover(s: DriverState, step: int, phase: str, why: str, peer: int | None) -> None:
    """Recover in place from a failed step (module docstring): report it, then rounds of
    agree -> replan -> regroup -> transfer until one completes (a failure inside a round
    starts the next from the same base); the new plan's first commit ends the recovery
    (driver.py, `committed`). Raises GuaranteeExceeded / RecoveryError for the checkpoint
    fallback."""
    rec, held = report(s, step, phase, why, peer)
    run_rounds(s, rec, held, why)


def run_rounds(s: DriverState, rec: Recovery, held: Engine | None, why: str) -> None:
    """Rounds of agree -> replan -> regroup -> transfer from the base engine until one
    completes (`recover`; a drain starts here, control/drain.py: nothing failed)."""
    while True:
        try:
            m = agree(s, rec, held)
            held = None
            new_plan, lost = replan(s, m, rec, why)
            s.base.release_step_memory()  # it never steps again: only its state counts
            comm, groups = regroup_round(s, m, new_plan, rec)
            engine = transfer(s, m, new_plan, comm, groups, rec)
        except Superseded:
            teardown(s)
            continue
        except (RuntimeError, TimeoutError, ValueError) as e:
            round_failed(s, rec, e)
            continue
        rec.joined = tuple(n for n in new_plan.nodes if n not in s.base_plan.nodes)
        rec.lost = tuple(sorted(set(rec.lost) | set(lost)))
        rec.generation, rec.plan = m.gen, new_plan.digest()
        s.plan, s.engine = new_plan, engine
        return


def report(s: DriverState, step: int, phase: str, why: str,
           peer: int | None) -> tuple[Recovery, Engine | None]:
    """The step failed here: tell the run and the agent (naming the peer whose connection
    broke, if any), keep the base engine and an engine holding a prepared step (settled by
    `reconcile`), drop this generation's groups. Returns (the recovery record, the engine
    holding a prepared step or None)."""
    suspects = []
    if peer is not None and s.plan is not None and 0 <= peer < s.plan.world_size:
        suspects = [s.plan.ranks[peer].node]
    suspects = [n for n in suspects if n != s.node]
    s.events.emit("step_failed", step=step + 1, phase=phase, peer=peer, suspects=suspects,
                  error=why[:300], generation=s.gen)
    s.client.report_failure("comm_error", f"step {step + 1} {phase}: {why[:200]}",
                            suspects, gen=s.gen)
    if s.faults is not None:
        s.faults.on_failed_step(step + 1)
    return set_aside(s, step)


def admit(s: DriverState, step: int) -> None:
    """A round that only adds nodes opened at the step boundary after step `step`
    (membership.py, 7b: the members open it once a commit vote completed, so every member
    committed that step; the next one, which this rank may have begun, did nothing it must
    keep): reconfigure with the joiners from the committed step, as after a drain -- nothing
    failed, nothing is replayed. A member that held the step prepared (its vote was the one
    superseded) goes through `recover` instead."""
    rec, _ = set_aside(s, step)
    run_rounds(s, rec, None, "a node joins at the step boundary")


def set_aside(s: DriverState, step: int) -> tuple[Recovery, Engine | None]:
    """Step `step` cannot go on in this generation: keep the base engine and an engine holding
    a prepared step (settled by `reconcile`), drop this generation's groups, and open (or count
    a round of) the recovery under way. Returns (its record, the engine holding a prepared
    step or None)."""
    engine, s.engine = s.engine, None
    if s.base is None:  # the current engine was the base
        s.base, s.base_plan = engine, s.plan
    held = engine if engine is not None and engine.prepared is not None else None
    if engine is not None and engine is not s.base and held is None:
        engine.close()
    teardown(s)
    if s.pending is None:
        s.pending = Recovery(step + 1, (), s.gen, "", time.time())
    else:
        s.pending.rounds += 1
    return s.pending, held


def agree(s: DriverState, rec: Recovery, held: Engine | None) -> Membership:
    """Wait for the agents' next generation (RecoveryError when none is decided in time),
    then settle with the survivors a step `held` prepared (`reconcile`)."""
    t0 = time.time()
    m = wait_membership(s, s.gen)
    s.gen, s.view = m.gen, m.nodes
    reconcile(s, m.gen, held)
    rec.phases["agree"] = rec.phases.get("agree", 0.0) + (time.time() - t0)
    return m


def replan(s: DriverState, m: Membership, rec: Recovery, why: str) -> tuple[Plan, tuple[str, ...]]:
    """The plan for the survivors of generation `m`: reconfigured without the nodes the base
    plan lost, or the base plan itself when none was lost (a retry in place, at most
    MAX_RETRIES in a row: also counted when a recovery's new plan fails its first step with
    no further loss, which would otherwise reconfigure from the base for ever). Returns
    (plan, lost nodes)."""
    t0 = time.time()
    lost = tuple(n for n in s.base_plan.nodes if n not in m.nodes)
    joined = tuple(n for n in m.nodes if n not in s.base_plan.nodes)
    if not m.lost and not m.joined:  # the agents' decision: the same on every survivor
        s.retries += 1
        if s.retries > MAX_RETRIES:
            raise RecoveryError(
                f"step {s.base.state.step + 1} failed {s.retries} times in a row with "
                f"no node lost (last: {why[:200]}); falling back to the last checkpoint")
    if s.planned is not None and s.planned[0] == (s.base_plan.digest(), lost) \
            and not joined:  # a drain's verdict computed it already (planned.py)
        new_plan = s.planned[1]
    elif lost or joined:
        new_plan = _reconfigured(s, m, lost, joined)
    else:
        new_plan = s.base_plan
    new_plan = replace(new_plan, generation=m.gen)
    rec.phases["plan"] = rec.phases.get("plan", 0.0) + (time.time() - t0)
    if new_plan.rank_of(s.node, s.local_rank) == 0:
        s.events.emit("membership_agreed", generation=m.gen, nodes=list(m.nodes),
                      lost=list(lost), joined=list(joined), store=m.store_addr)
        plan_chosen(s, new_plan, lost=lost, joined=joined,
                    plan_seconds=round(time.time() - t0, 4))
    return new_plan, lost


def _reconfigured(s: DriverState, m: Membership, lost: tuple[str, ...],
                  joined: tuple[str, ...]) -> Plan:
    """The base plan reconfigured without `lost` and with `joined` (planning/reconfigure.py);
    no plan for these survivors is the checkpoint fallback at once (no round would find one),
    naming them for the requeue (GuaranteeExceeded)."""
    from oobleck_hpc.planning.cost import job_profile
    from oobleck_hpc.planning.reconfigure import reconfigure

    try:  # the same (core-scaled) profile the templates were built from
        return reconfigure(s.base_plan, lost, s.templates, job_profile(s.job, s.profile),
                           s.job.fault_tolerance.f, joined=joined)
    except GuaranteeExceeded as e:  # the requeued job starts on the nodes it has
        raise GuaranteeExceeded(str(e), survivors=tuple(m.nodes)) from e
    except PlanningError as e:  # no plan for these survivors: no round would find one
        raise GuaranteeExceeded(f"no plan for the {len(m.nodes)} nodes left: {e}",
                                survivors=tuple(m.nodes)) from e


def plan_chosen(s: DriverState, plan: Plan, **fields: Any) -> None:
    """The `plan_chosen` event (rank 0 of the plan): what the console and the report show."""
    from oobleck_hpc.planning.cost import job_profile, predicted_step_ms, sharing_note

    s.events.emit("plan_chosen", generation=plan.generation, plan=plan.digest(),
                  pipelines=[p.template.num_nodes for p in plan.pipelines],
                  microbatches=[p.microbatches for p in plan.pipelines],
                  nodes=len(plan.nodes), gpus_per_node=plan.gpus_per_node,
                  predicted_step_ms=round(predicted_step_ms(
                      plan, job_profile(s.job, s.profile)), 3),
                  note=sharing_note(s.job, s.profile), layout=plan.layout(),
                  **fields)


def regroup_round(s: DriverState, m: Membership, new_plan: Plan,
                  rec: Recovery) -> tuple[Comm, PlanGroups]:
    """Confirm that every survivor computed the same plan from the same state (an exchange;
    any difference is a hard error: never continue with a wrong model), then rendezvous on
    the generation's store and build the new plan's groups."""
    state = s.base.state
    mine = [s.base_plan.digest(), new_plan.digest(), state.step, state.cursor]
    values = s.client.exchange(f"recover-{m.gen}", mine, timeout=s.agree_s, gen=m.gen)
    other = [v for per_node in values.values() for v in per_node if v != mine]
    if other:
        raise RecoveryError(
            f"survivors disagree on the recovery of generation {m.gen}: this rank has (base "
            f"plan, new plan, step, cursor) = {mine}, another {other[0]}; falling back to "
            "the last checkpoint")
    if s.faults is not None:
        s.faults("reconfiguration", state.step + 1)
    if round_opened(s):  # the exchange may have completed here only
        raise Superseded(f"generation {m.gen} superseded before regrouping")
    t0 = time.time()
    comm, groups = regroup(s, m, new_plan, s.rendezvous_s)
    seconds = time.time() - t0
    rec.phases["regroup"] = rec.phases.get("regroup", 0.0) + seconds
    if comm.rank == 0:
        s.events.emit("groups_rebuilt", generation=m.gen, world=comm.world_size,
                      groups=len(groups.groups), seconds=round(seconds, 4))
    return comm, groups


def transfer(s: DriverState, m: Membership, new_plan: Plan, comm: Comm, groups: PlanGroups,
             rec: Recovery) -> Engine:
    """The new plan's engine: it adopts the base's modules and AdamW state for the layers
    this rank keeps (no copy), allocates the layers it receives uninitialised, and receives
    them from surviving replicas (recovery/transfer.py). Returns the engine."""
    from oobleck_hpc.engine import Engine
    from oobleck_hpc.engine.groups import Aborted, Waiter
    from oobleck_hpc.planning.reconfigure import transfer_plan
    from oobleck_hpc.recovery import transfer as transfer_state

    t0 = time.time()
    abort = partial(round_opened, s)
    info = new_plan.ranks[comm.rank]
    receive = [i for i in range(info.layer_start, info.layer_end) if i not in s.base.layers]
    engine = Engine(s.job, s.model, new_plan, comm, groups, s.dataset, s.device,
                    state=replace(s.base.state), on_phase=partial(on_phase, s),
                    abort=abort, adopt=s.base, receive=receive)
    t1 = time.time()
    rec.phases["init"] = rec.phases.get("init", 0.0) + (t1 - t0)
    waiter = Waiter("transfer-wait")
    try:
        moves = transfer_plan(s.base_plan, new_plan, s.profile, s.fresh)
        if s.faults is not None:
            s.faults("transfer", s.base.state.step + 1)
        nodes = sorted({new_plan.ranks[r].node for r in transfer_state.peers(moves, comm.rank)})
        watch = watched(s, m.gen, "the transfer", lambda: nodes, abort)
        stats = transfer_state.execute(
            moves, comm.rank, s.base, engine,
            lambda works: comm.wait(works, waiter, watch, sync=True))
    except Aborted as e:  # a newer round opened: its members wait for this rank there
        engine.close()
        raise Superseded(f"generation {m.gen} superseded during the transfer") from e
    except BaseException:
        engine.close()
        raise
    finally:
        waiter.close()
    rec.phases["transfer"] = rec.phases.get("transfer", 0.0) + (time.time() - t1)
    rec.bytes_moved = sum(t.nbytes for t in moves)
    s.events.emit("state_transferred", generation=m.gen, rank=comm.rank,
                  sent_bytes=stats.sent_bytes, received_bytes=stats.received_bytes,
                  layers_in=stats.received_layers, layers_out=stats.sent_layers,
                  seconds=round(stats.seconds, 4), init_seconds=round(rec.phases["init"], 4))
    return engine


def round_failed(s: DriverState, rec: Recovery, error: BaseException) -> None:
    """A failure during reconfiguration of generation `s.gen`: report it and start a new
    round from the same base (module docstring); after MAX_ROUNDS, RecoveryError."""
    s.events.emit("reconfiguration_failed", generation=s.gen, error=repr(error)[:300])
    s.client.report_failure("comm_error", f"reconfiguration of generation {s.gen}: "
                            f"{error!r}"[:300], gen=s.gen)
    teardown(s)
    rec.rounds += 1
    if rec.rounds > MAX_ROUNDS:
        raise RecoveryError(f"the recovery from step {rec.step} failed {rec.rounds} rounds "
                            f"(last: {error!r}); falling back to the last checkpoint") from error


def wait_membership(s: DriverState, after_gen: int) -> Membership:
    """The next decided generation; no decision within the agreement bound is a dead end
    for in-place recovery, so the checkpoint fallback takes over (RecoveryError)."""
    try:
        return s.client.wait_membership(after_gen=after_gen, timeout=s.agree_s)
    except TimeoutError as e:
        raise RecoveryError(f"no membership decided after generation {after_gen} within "
                            f"{s.agree_s:.0f} s ({e}); falling back to the last "
                            "checkpoint") from e


def restart(s: DriverState, gen: int, error: BaseException) -> Membership:
    """A start or a join on generation `gen` failed (driver.py, join.py): report it (unless a
    round is already what stopped it), drop the groups, and wait for the next generation."""
    s.events.emit("rendezvous_failed", generation=gen, error=repr(error)[:300])
    if not isinstance(error, Superseded):
        s.client.report_failure("comm_error", f"start on generation {gen}: "
                                f"{error!r}"[:300], gen=gen)
    teardown(s)
    return wait_membership(s, gen)


def reconcile(s: DriverState, gen: int, held: Engine | None) -> None:
    """Settle the step a failed vote left open (driver.py docstring, "Transactional step").

    Every survivor says where it stands: (base plan digest, committed step, cursor, digest
    of the plan of a step it holds prepared or ""). The furthest committed step wins: a
    survivor one step behind that holds that very step prepared commits it now (roll
    forward; the vote completed somewhere, so every member had prepared it), a prepared
    step nobody committed is dropped (roll back). Anything else cannot be made consistent
    in place: RecoveryError."""
    state = s.base.state
    mine = Standing(s.base_plan.digest(), state.step, state.cursor,
                    held.plan.digest() if held is not None else "",
                    tuple(tuple(p.nodes) for p in s.base_plan.pipelines),
                    s.base_plan.generation, s.template_nodes)
    values = s.client.exchange(f"reconcile-{gen}", asdict(mine), timeout=s.agree_s, gen=gen)
    every = Standing.gathered(values)
    s.fresh = Standing.fresh(values, s.base_plan.nodes)
    target = max(x.step for x in every)
    ahead = {(x.base, x.step, x.cursor) for x in every if x.step == target}
    if len(ahead) != 1:
        raise RecoveryError(f"survivors committed step {target} on different plans or "
                            f"cursors: {sorted(ahead)}; falling back to the last checkpoint")
    digest, _, cursor = ahead.pop()
    if state.step == target:
        if held is not None:
            held.rollback()
            if held is not s.base:
                held.close()
        return
    if not (state.step == target - 1 and held is not None and held.plan.digest() == digest
            and held.state.cursor + held.sampler.global_batch == cursor):
        raise RecoveryError(
            f"this rank stands at step {state.step} (prepared: {mine.prepared or 'none'}) while "
            f"survivors committed step {target} on plan {digest}; falling back to the last "
            "checkpoint")
    result = held.commit()
    if held is not s.base:
        s.base.close()
        s.base, s.base_plan = held, held.plan
    s.rolled.append(result)
    if s.pending is not None:  # the failed step is committed now: the next is replayed
        s.pending.step = held.state.step + 1
    s.events.emit("rolled_forward", step=result.step + 1, generation=gen,
                  plan=held.plan.digest())
