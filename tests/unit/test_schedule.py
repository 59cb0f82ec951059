"""The 1F1B schedule as pure data: sweeps over shapes, a validator that catches every broken
variant we can make by hand, and the printed grid."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from oobleck_hpc.engine.schedule import (
    Action,
    check_batched,
    ScheduleError,
    grid,
    max_in_flight,
    one_f_one_b,
    pipeline_schedule,
    plan_schedule,
    simulate,
    split_rows,
    validate,
)
from oobleck_hpc.planning.plan import PipelineSpec, Plan, StageSpec, Template


def _stage_ranks(replicas: list[int]) -> list[list[int]]:
    out, r = [], 0
    for n in replicas:
        out.append(list(range(r, r + n)))
        r += n
    return out


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("microbatches", [0, 1, 2, 3, 5, 8, 13])
def test_1f1b_sweep_is_valid(stages: int, microbatches: int) -> None:
    sched = pipeline_schedule(_stage_ranks([1] * stages), microbatches, microbatch_size=2)
    validate(sched)
    for s in range(stages):
        order = one_f_one_b(stages, microbatches, s)
        assert sorted(order) == sorted([("F", k) for k in range(microbatches)]
                                       + [("B", k) for k in range(microbatches)])
        # 1F1B keeps at most S - s microbatches alive on stage s.
        assert max_in_flight(sched[s]) <= min(stages - s, max(microbatches, 0)) or microbatches == 0


def test_1f1b_makespan_matches_the_formula() -> None:
    # With F = 1 and B = 2 units and free transfers, 1F1B takes (M + S - 1) * (F + B).
    for s, m in itertools.product(range(1, 6), range(1, 9)):
        tl = simulate(pipeline_schedule(_stage_ranks([1] * s), m, 1))
        end = max(t1 for v in tl.values() for _, t1, _ in v)
        assert end == (m + s - 1) * 3, (s, m, end)


@pytest.mark.parametrize("replicas", [[2], [1, 2], [2, 1], [2, 2, 1], [3, 2], [1, 3, 2, 1], [2, 3]])
@pytest.mark.parametrize("mbsize", [3, 4, 7])
def test_multi_gpu_stages_split_rows_and_match(replicas: list[int], mbsize: int) -> None:
    ranks = _stage_ranks(replicas)
    sched = pipeline_schedule(ranks, 4, mbsize)
    validate(sched)
    # Every rank computes exactly its share of rows; the rows a stage receives for microbatch k
    # tile its share exactly.
    for s, rs in enumerate(ranks):
        shares = split_rows(mbsize, len(rs))
        for replica, r in enumerate(rs):
            f = [a for a in sched[r] if a.kind == "F" and a.microbatch == 0][0]
            assert f.rows == shares[replica]
            if s > 0:
                got = sorted(a.rows for a in sched[r] if a.kind == "RECV_ACT" and a.microbatch == 0)
                assert got[0][0] == f.rows[0] and got[-1][1] == f.rows[1]
                assert all(x[1] == y[0] for x, y in zip(got, got[1:]))


def test_split_rows() -> None:
    assert split_rows(5, 2) == [(0, 3), (3, 5)]
    assert split_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n, p in itertools.product(range(1, 12), range(1, 5)):
        parts = split_rows(n, p)
        assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == p


def test_too_many_gpus_for_a_microbatch_is_a_clear_error() -> None:
    with pytest.raises(ScheduleError, match="microbatch_size to at least 3"):
        pipeline_schedule(_stage_ranks([1, 3]), 2, 2)


def _broken(sched: dict[int, list[Action]], rank: int, fn) -> dict[int, list[Action]]:
    out = {r: list(a) for r, a in sched.items()}
    out[rank] = fn(out[rank])
    return out


def test_validator_catches_broken_schedules() -> None:
    good = pipeline_schedule(_stage_ranks([1, 1, 1]), 4, 1)
    validate(good)

    def swap_first_forwards(acts):  # stage 1 receives mb1 before mb0: order mismatch
        i = [j for j, a in enumerate(acts) if a.kind == "RECV_ACT"][:2]
        acts[i[0]], acts[i[1]] = acts[i[1]], acts[i[0]]
        return acts

    with pytest.raises(ScheduleError):
        validate(_broken(good, 1, swap_first_forwards))

    def drop_a_send(acts):  # the last activation never leaves: its receiver waits forever
        j = max(j for j, a in enumerate(acts) if a.kind == "SEND_ACT")
        return acts[:j] + acts[j + 1:]

    with pytest.raises(ScheduleError, match="deadlock"):
        validate(_broken(good, 0, drop_a_send))

    def drop_a_recv(acts):
        j = next(j for j, a in enumerate(acts) if a.kind == "RECV_GRAD")
        return acts[:j] + acts[j + 1:]

    with pytest.raises(ScheduleError, match="never received|different orders"):
        validate(_broken(good, 1, drop_a_recv))

    def backward_first(acts):
        b = next(j for j, a in enumerate(acts) if a.kind == "B")
        f = next(j for j, a in enumerate(acts) if a.kind == "F")
        acts[b], acts[f] = acts[f], acts[b]
        return acts

    with pytest.raises(ScheduleError, match="before its forward"):
        validate(_broken(good, 2, backward_first))

    def all_forwards_last_stage_backward_first(acts):
        # Last stage waits for a gradient nobody sends before doing its forwards -> deadlock.
        return [Action("RECV_GRAD", 0, (0, 1), 0)] + acts

    with pytest.raises(ScheduleError):
        validate(_broken(good, 2, all_forwards_last_stage_backward_first))

    def wrong_rows(acts):
        j = next(j for j, a in enumerate(acts) if a.kind == "RECV_ACT")
        acts[j] = dataclasses.replace(acts[j], rows=(0, 2))
        return acts

    with pytest.raises(ScheduleError, match="different orders"):
        validate(_broken(good, 1, wrong_rows))


def _template(n_nodes: int, stages: list[tuple[int, int, int, tuple[int, ...]]]) -> Template:
    specs = tuple(StageSpec(a, b, n, g) for a, b, n, g in stages)
    k = len(specs)
    return Template(n_nodes, 2, specs, (1.0,) * k, (2.0,) * k, (0.5,) * (k - 1), (0,) * k)


def test_plan_schedule_for_heterogeneous_pipelines() -> None:
    t1 = _template(1, [(0, 3, 0, (0,)), (3, 6, 0, (1,))])
    t2 = _template(2, [(0, 2, 0, (0, 1)), (2, 4, 1, (0,)), (4, 6, 1, (1,))])
    plan = Plan((PipelineSpec(t1, ("a",), 5), PipelineSpec(t2, ("b", "c"), 3)), 8, 0.0)
    sched = plan_schedule(plan, microbatch_size=2)
    assert sorted(sched) == list(range(6))
    validate(sched)
    assert sum(1 for a in sched[0] if a.kind == "F") == 5
    assert sum(1 for a in sched[5] if a.kind == "F") == 3
    text = grid(sched)
    assert text.splitlines()[0].startswith("rank   0 | F0")
    assert len(text.splitlines()) == 6
    print(text)


def test_nccl_batch_model_catches_what_gloo_order_allows() -> None:
    # Both ranks send first and receive later, in separate batches: fine with gloo's buffered
    # sends, a deadlock with NCCL's in-order streams.
    sched = {
        0: [Action("F", 0, (0, 1)), Action("SEND_ACT", 0, (0, 1), 1),
            Action("F", 1, (0, 1)), Action("RECV_ACT", 0, (0, 1), 1)],
        1: [Action("F", 0, (0, 1)), Action("SEND_ACT", 0, (0, 1), 0),
            Action("F", 1, (0, 1)), Action("RECV_ACT", 0, (0, 1), 0)],
    }
    simulate(sched)
    with pytest.raises(ScheduleError, match="NCCL"):
        check_batched(sched)
    # The same transfers posted in one batch each are fine.
    for r in sched:
        sched[r] = [sched[r][0], sched[r][1], sched[r][3], sched[r][2]]
    check_batched(sched)
