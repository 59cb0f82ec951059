"""A node that joins a running job (membership.py, step 7): a spare swapped in by a round, or a
node that stepped out after a worker crashed (control/agent.py). It takes part in that round's
recovery like a survivor with nothing to give: it learns the members' committed state and base
plan from the reconcile exchange, computes the same new plan, rendezvous, and receives every
layer of its rank (weights and AdamW state) from the members (recovery/rounds.py). Functions of
the driver's state (recovery/state.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from oobleck_hpc.control.membership import Superseded
from oobleck_hpc.recovery.rounds import (Recovery, RecoveryError, regroup_round, replan, restart,
                                          transfer)
from oobleck_hpc.recovery.standing import JOINER, Standing

if TYPE_CHECKING:
    from oobleck_hpc.engine import Comm
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.recovery.state import DriverState


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


def join(s: DriverState, first_nodes: Sequence[str],
         after_gen: int | None = None) -> tuple[Plan, Comm]:
    """A spare's start: wait -- for the whole run if no loss needs this node -- until a round
    swaps it in, then take part in that round's recovery (module docstring). The engine it
    builds holds exactly the members' committed state; the round's replayed step is this
    node's first. Returns (plan, comm) like `ElasticDriver.start`. `first_nodes`: generation
    0's nodes, whose count the templates are built for while this node waits (the members say
    theirs: a start that lost nodes built them for fewer, `joining_base`).

    The workers of a node that stepped out after a crash start here too, with `after_gen`:
    the generation the node left; they join when a round adds it again, as a spare's do."""
    # What an engine's first build costs once per process, paid now instead of during the
    # swap: the optimizer's first construction imports torch._dynamo (~1 s on a 2-core
    # machine, measured: the whole of a joiner's engine init).
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    build_templates(s, len(first_nodes))
    m = s.client.wait_membership(after_gen=-1 if after_gen is None else after_gen)
    t_told = time.time()
    while True:
        s.gen, s.view = m.gen, m.nodes
        rec = Recovery(0, (), m.gen, "", t_told)
        try:
            s.base = joining_base(s, m.gen)
            s.base_plan = s.base.plan
            rec.step = s.base.state.step + 1
            new_plan, lost = replan(s, m, rec, "join")
            comm, groups = regroup_round(s, m, new_plan, rec)
            engine = transfer(s, m, new_plan, comm, groups, rec)
            # (as the members' record of the round: the joiner may be rank 0, the teller)
            rec.joined = tuple(n for n in new_plan.nodes if n not in s.base_plan.nodes)
            rec.lost, rec.plan = tuple(sorted(lost)), new_plan.digest()
        except (Superseded, RuntimeError, TimeoutError, ValueError) as e:
            m = restart(s, m.gen, e)
            continue
        s.plan, s.engine, s.comm = new_plan, engine, comm
        s.pending = rec
        s.events.emit("node_joined" if after_gen is None else "worker_rejoined",
                      node=s.node, generation=m.gen, step=rec.step,
                      seconds=round(time.time() - t_told, 4), phases={
                          k: round(v, 4) for k, v in rec.phases.items()},
                      received_bytes=rec.bytes_moved if s.local_rank == 0 else None)
        return new_plan, comm


def joining_base(s: DriverState, gen: int) -> Joining:
    """The members' committed state and base plan, from generation `gen`'s reconcile
    exchange (a joiner says step -1: the members leave it out)."""
    from oobleck_hpc.engine import TrainState
    from oobleck_hpc.planning.cost import job_profile
    from oobleck_hpc.planning.reconfigure import plan_from_groups

    values = s.client.exchange(f"reconcile-{gen}", asdict(JOINER), timeout=s.agree_s, gen=gen)
    members = Standing.gathered(values)
    step = max(x.step for x in members)
    ahead = {(x.base, x.cursor, x.groups, x.base_gen, x.template_nodes)
             for x in members if x.step == step}
    if len(ahead) != 1:
        raise RecoveryError(f"the members of generation {gen} committed step {step} on "
                            f"different plans or cursors: {sorted(ahead)}")
    digest, cursor, groups, base_gen, template_nodes = ahead.pop()
    if template_nodes != s.template_nodes:
        build_templates(s, template_nodes)
    plan = plan_from_groups([list(g) for g in groups], s.templates,
                            s.job.train.global_microbatches,
                            job_profile(s.job, s.profile), base_gen)
    if plan is None or plan.digest() != digest:
        raise RecoveryError(f"this joining node rebuilt the members' base plan as "
                            f"{plan.digest() if plan else None}, they have {digest}")
    s.fresh = Standing.fresh(values, plan.nodes)
    return Joining(TrainState(step=step, cursor=cursor), plan)


def build_templates(s: DriverState, num_nodes: int) -> None:
    """The job's templates for `num_nodes` nodes, as the members built theirs."""
    from oobleck_hpc.planning import job_templates

    _, s.templates = job_templates(s.job, s.profile, num_nodes)
    s.template_nodes = num_nodes
