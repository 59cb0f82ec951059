"""Node specification: n0, template sizes (every feasible size up to N), the covering property
(proof in planning/spec.py) checked over random (n0, N, f), and refusals that carry the numbers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_hpc.errors import PlanningError
from oobleck_hpc.planning.spec import decompose, node_specification
from oobleck_hpc.profiling.analytic import analytic_profile
from test_planning_templates import random_profile


@settings(max_examples=300, deadline=None)
@given(n0=st.integers(1, 40), f=st.integers(0, 6), extra=st.integers(0, 200))
def test_every_survivor_count_is_covered_with_enough_pipelines(n0, f, extra):
    # every count the job can be at after k <= f losses, including below (f + 1) * n0
    N = (f + 1) * n0 + extra
    for M in range(N - f, N + 1):
        parts = decompose(M, n0)
        assert sum(parts) == M
        assert len(parts) >= min(f + 1, M // n0) >= f + 1 - (N - M)
        assert all(n0 <= p <= min(2 * n0 - 1, N) for p in parts), (M, parts)


def test_decompose_rejects_counts_below_n0():
    with pytest.raises(ValueError):
        decompose(2, 3)


def test_analytic_175b_spec():
    prof = analytic_profile("gpt3-175b", "H100-80G", 1)
    spec = node_specification(prof, 1024, 3)
    assert spec.n0 >= 5  # 2.8 TB of fp32 state + Adam do not fit on fewer 8 x 80 GB nodes
    # templates up to the useful size: a node holds at least one of the 98 layers
    assert spec.template_sizes == tuple(range(spec.n0, 99))


def test_too_few_nodes_is_refused_with_the_numbers():
    prof = analytic_profile("gpt3-175b", "H100-80G", 1)
    n0 = node_specification(prof, 64, 0).n0
    with pytest.raises(PlanningError) as e:
        node_specification(prof, 2 * n0, 3)
    msg = str(e.value)
    assert f"n0 = {n0}" in msg and f"at least (f + 1) * n0 = {4 * n0}" in msg
    assert "lower fault_tolerance.f to 1" in msg


def test_model_that_fits_nowhere_is_refused():
    prof = random_profile(random.Random(1), 4, 2, memory=1000)
    with pytest.raises(PlanningError, match="fits on no number of nodes"):
        node_specification(prof, 8, 1)


def test_sizes_are_the_feasible_range_up_to_the_job_size():
    prof = random_profile(random.Random(5), 10, 1, memory=600_000)  # n0 = 3
    for N, f, sizes in [(6, 1, range(3, 7)), (9, 2, range(3, 10)), (12, 1, range(3, 11))]:
        spec = node_specification(prof, N, f)
        assert spec.n0 == 3
        # up to N (and the 10 layers), not N - f * n0: after losses fewer, larger pipelines
        # cover the survivors (6 nodes, f = 1: the 5 survivors need a 5-node pipeline)
        assert spec.template_sizes == tuple(sizes)
