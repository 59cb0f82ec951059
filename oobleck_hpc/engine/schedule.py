"""Pipeline schedules as plain data: per-rank action lists, a validator and a printable grid.

Why our own schedule and not `torch.distributed.pipelining`: its schedules drive ONE pipeline
whose stages each map to one rank of one process group, with shape inference and its own
process-group assumptions. Our plans run several pipelines built from *different* templates side
by side, a stage may span several GPUs of a node (samples of every microbatch split across them,
so one stage-to-stage transfer becomes several row-slices between ranks), gradients are reduced
per layer across pipelines, and every process group must be torn down and rebuilt in place
after a failure. The schedule is a few dozen lines of data; owning it keeps all of that simple.

The 1F1B order (PipeDream-flush / Megatron) of stage s of S with M microbatches:

    warm-up  w = min(S - 1 - s, M) forwards:  F0 .. F(w-1)
    steady   for i in 0 .. M-w-1:             F(w+i), B(i)
    cool-down                                 B(M-w) .. B(M-1)

At most S - s microbatches are in flight on stage s, so S - s activation buffers suffice.

Per rank this becomes a list of `Action`s. A stage with R GPUs splits each microbatch's rows
(samples) into R contiguous shares (`split_rows`); the activation of microbatch k travels from
every rank of stage s to every rank of stage s+1 whose row share overlaps, one message per
overlap (`RECV_ACT`/`SEND_ACT` with the rows), and the gradient travels back the same way.

Execution semantics (what the validator simulates and the engine does): a send is posted
without blocking (isend) and completes when matched; a receive blocks until the matching send
is posted. Messages between one ordered pair of ranks are matched in posting order, so the
validator also checks that both sides post them in the same order (kind, microbatch, rows),
and -- for NCCL, which runs a pair's transfers on one stream in posting order -- that the
batches of transfers the engine posts together (`transfer_batches`) correspond pairwise.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from oobleck_hpc.planning.plan import Plan

Kind = Literal["F", "B", "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"]
COMPUTE = ("F", "B")
SHORT = {"F": "F", "B": "B", "RECV_ACT": "rA", "SEND_ACT": "sA", "RECV_GRAD": "rG", "SEND_GRAD": "sG"}


class ScheduleError(ValueError):
    """A schedule that would compute out of order, leave a message unmatched, or deadlock."""


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    rows: tuple[int, int]
    """Rows [start, end) of the microbatch this action computes or transfers."""
    peer: int = -1
    """The other rank of a transfer; -1 for compute."""

    def __str__(self) -> str:
        s = f"{SHORT[self.kind]}{self.microbatch}"
        if self.kind.startswith("SEND"):
            return f"{s}>{self.peer}"
        if self.kind.startswith("RECV"):
            return f"{s}<{self.peer}"
        return s


def split_rows(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous shares of n rows over `parts` GPUs; the first n % parts get one extra row."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The compute order of one stage under 1F1B: [("F", 0), ("F", 1), ("B", 0), ...]."""
    m = num_microbatches
    w = min(num_stages - 1 - stage, m)
    order = [("F", k) for k in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    order += [("B", k) for k in range(m - w, m)]
    return order


def pipeline_schedule(stage_ranks: list[list[int]], num_microbatches: int,
                      microbatch_size: int) -> dict[int, list[Action]]:
    """Action lists for the ranks of one pipeline. `stage_ranks[s]` = the ranks of stage s in
    replica order (replica r owns rows split_rows(microbatch_size, len(stage_ranks[s]))[r])."""
    num_stages = len(stage_ranks)
    for s, ranks in enumerate(stage_ranks):
        if len(ranks) > microbatch_size:
            raise ScheduleError(
                f"stage {s} has {len(ranks)} GPUs but a microbatch has only {microbatch_size} "
                f"samples to split across them; raise train.microbatch_size to at least {len(ranks)}")
    shares = [split_rows(microbatch_size, len(r)) for r in stage_ranks]

    def overlaps(s_from: int, s_to: int, replica: int) -> list[tuple[int, tuple[int, int]]]:
        """(peer rank, rows) for every replica of stage s_to whose rows overlap `replica`'s."""
        a0, a1 = shares[s_from][replica]
        out = []
        for j, (b0, b1) in enumerate(shares[s_to]):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((stage_ranks[s_to][j], (lo, hi)))
        return out

    out: dict[int, list[Action]] = {}
    for s, ranks in enumerate(stage_ranks):
        for replica, rank in enumerate(ranks):
            rows = shares[s][replica]
            prev = overlaps(s, s - 1, replica) if s > 0 else []
            nxt = overlaps(s, s + 1, replica) if s < num_stages - 1 else []
            actions: list[Action] = []
            for kind, k in one_f_one_b(num_stages, num_microbatches, s):
                if kind == "F":
                    actions += [Action("RECV_ACT", k, r, p) for p, r in prev]
                    actions.append(Action("F", k, rows))
                    actions += [Action("SEND_ACT", k, r, p) for p, r in nxt]
                else:
                    actions += [Action("RECV_GRAD", k, r, p) for p, r in nxt]
                    actions.append(Action("B", k, rows))
                    actions += [Action("SEND_GRAD", k, r, p) for p, r in prev]
            out[rank] = actions
    return out


def plan_schedule(plan: Plan, microbatch_size: int) -> dict[int, list[Action]]:
    """Action lists for every rank of a plan (all pipelines)."""
    out: dict[int, list[Action]] = {}
    for p, spec in enumerate(plan.pipelines):
        stage_ranks = [[plan.rank_of(spec.nodes[st.node], g) for g in st.gpus]
                       for st in spec.template.stages]
        out.update(pipeline_schedule(stage_ranks, spec.microbatches, microbatch_size))
    return out


# ----------------------------------------------------------------------------- validation


def simulate(schedule: dict[int, list[Action]], forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> dict[int, list[tuple[float, float, Action]]]:
    """Run the schedule with blocking receives and non-blocking sends; returns per rank the
    (start, end, action) of every compute action. Raises ScheduleError on a mismatch, an
    unmatched message or a deadlock. Transfers take no time."""
    channels: dict[tuple[int, int], deque[tuple[float, Action]]] = defaultdict(deque)
    pc = {r: 0 for r in schedule}
    clock = {r: 0.0 for r in schedule}
    timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in schedule}
    unknown = {a.peer for acts in schedule.values() for a in acts if a.peer >= 0} - set(schedule)
    if unknown:
        raise ScheduleError(f"transfers name ranks {sorted(unknown)} that have no action list")
    progress = True
    while progress:
        progress = False
        for r, acts in schedule.items():
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind in COMPUTE:
                    cost = forward_cost if a.kind == "F" else backward_cost
                    timeline[r].append((clock[r], clock[r] + cost, a))
                    clock[r] += cost
                elif a.kind.startswith("SEND"):
                    channels[(r, a.peer)].append((clock[r], a))
                else:
                    chan = channels[(a.peer, r)]
                    if not chan:
                        break  # blocked until the peer posts its send
                    t_sent, sent = chan.popleft()
                    want = "SEND_" + a.kind.removeprefix("RECV_")
                    if (sent.kind, sent.microbatch, sent.rows) != (want, a.microbatch, a.rows):
                        raise ScheduleError(
                            f"rank {r} receives {a} but rank {a.peer} sent {sent} first: "
                            f"the two sides post messages in different orders")
                    clock[r] = max(clock[r], t_sent)
                pc[r] += 1
                progress = True
    stuck = {r: str(schedule[r][pc[r]]) for r in schedule if pc[r] < len(schedule[r])}
    if stuck:
        raise ScheduleError(f"deadlock: ranks blocked at {stuck}")
    left = {k: [str(a) for _, a in v] for k, v in channels.items() if v}
    if left:
        raise ScheduleError(f"sends never received: {left}")
    return timeline


def validate(schedule: dict[int, list[Action]]) -> None:
    """Check the schedule: per rank, every microbatch is computed forward once and backward once,
    forward first, transfers of microbatch k come before (receives) or after (sends) its compute;
    every send is matched by a receive in the same order; it runs to the end without deadlock."""
    for r, acts in schedule.items():
        seen_f: set[int] = set()
        seen_b: set[int] = set()
        for a in acts:
            if a.kind == "F":
                if a.microbatch in seen_f:
                    raise ScheduleError(f"rank {r}: forward of microbatch {a.microbatch} twice")
                seen_f.add(a.microbatch)
            elif a.kind == "B":
                if a.microbatch not in seen_f:
                    raise ScheduleError(f"rank {r}: backward of microbatch {a.microbatch} "
                                        "before its forward")
                if a.microbatch in seen_b:
                    raise ScheduleError(f"rank {r}: backward of microbatch {a.microbatch} twice")
                seen_b.add(a.microbatch)
            elif a.kind in ("RECV_ACT",) and a.microbatch in seen_f:
                raise ScheduleError(f"rank {r}: {a} after the forward that needs it")
            elif a.kind == "SEND_ACT" and a.microbatch not in seen_f:
                raise ScheduleError(f"rank {r}: {a} before the forward that produces it")
            elif a.kind == "RECV_GRAD" and a.microbatch in seen_b:
                raise ScheduleError(f"rank {r}: {a} after the backward that needs it")
            elif a.kind == "SEND_GRAD" and a.microbatch not in seen_b:
                raise ScheduleError(f"rank {r}: {a} before the backward that produces it")
        if seen_f != seen_b:
            raise ScheduleError(f"rank {r}: microbatches {sorted(seen_f - seen_b)} have no backward")
    simulate(schedule)
    check_batched(schedule)


def transfer_batches(actions: list[Action]) -> list[list[Action]]:
    """The runs of consecutive transfers between two compute actions: the engine posts each run
    together (on NCCL as one `batch_isend_irecv`, i.e. one NCCL group)."""
    out: list[list[Action]] = []
    run: list[Action] = []
    for a in actions:
        if a.kind in COMPUTE:
            if run:
                out.append(run)
            run = []
        else:
            run.append(a)
    if run:
        out.append(run)
    return out


def check_batched(schedule: dict[int, list[Action]]) -> None:
    """Stricter than `simulate`, and what NCCL needs. NCCL runs a rank's transfers in posting
    order, except that the operations of one group (`batch_isend_irecv`) progress together; the
    engine posts each run of consecutive transfers (`transfer_batches`) as one group. Model: a
    rank blocks on its current batch until every operation in it is matched by its counterpart
    (the same-numbered transfer in the opposite direction of the pair) in the peer's current
    batch or an earlier one; compute never blocks. Raises ScheduleError on a deadlock. (1F1B
    posts "send activation k" and "receive gradient j" in one batch: without the batch, NCCL
    could deadlock where gloo, which only needs `simulate`'s per-direction order, does not.)"""
    steps = {r: transfer_batches(acts) for r, acts in schedule.items()}
    # Number every transfer within its direction: (src, dst, n) identifies a message.
    keyed: dict[int, list[list[tuple[int, int, int]]]] = {}
    for r, batches in steps.items():
        count: dict[tuple[int, int], int] = defaultdict(int)
        keyed[r] = []
        for batch in batches:
            ks = []
            for a in batch:
                src, dst = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
                ks.append((src, dst, count[(src, dst)]))
                count[(src, dst)] += 1
            keyed[r].append(ks)
    pos = {r: 0 for r in steps}
    posted: dict[tuple[int, int, int], set[int]] = defaultdict(set)  # message -> ranks posted
    for r in steps:
        if keyed[r]:
            for k in keyed[r][0]:
                posted[k].add(r)
    progress = True
    while progress:
        progress = False
        for r in steps:
            while pos[r] < len(keyed[r]) and all(len(posted[k]) == 2 for k in keyed[r][pos[r]]):
                pos[r] += 1
                progress = True
                if pos[r] < len(keyed[r]):
                    for k in keyed[r][pos[r]]:
                        posted[k].add(r)
    stuck = {r: [str(a) for a in steps[r][pos[r]]] for r in steps if pos[r] < len(steps[r])}
    if stuck:
        raise ScheduleError(f"deadlock under NCCL's in-order groups: ranks blocked at {stuck}")


def max_in_flight(actions: list[Action]) -> int:
    """Most microbatches forwarded but not yet backwarded at once (activation buffers needed)."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak


def grid(schedule: dict[int, list[Action]]) -> str:
    """A time-by-rank picture (forward = 1 unit, backward = 2), one row per rank:

        rank 0 | F0 F1 F2 B0 B0 F3 ...
    """
    timeline = simulate(schedule)
    end = int(max((t1 for tl in timeline.values() for _, t1, _ in tl), default=0))
    width = max([3] + [len(f"{a.kind}{a.microbatch}") + 1 for tl in timeline.values() for *_, a in tl])
    lines = []
    for r in sorted(timeline):
        cells = ["." for _ in range(end)]
        for t0, t1, a in timeline[r]:
            for t in range(int(t0), int(t1)):
                cells[t] = f"{a.kind}{a.microbatch}"
        lines.append(f"rank {r:>3} | " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)
