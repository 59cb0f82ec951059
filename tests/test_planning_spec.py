"""Node specification: n0, template sizes, the covering property (proof in planning/spec.py)
checked over random (n0, N, f), and refusals that carry the numbers."""

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
def test_every_count_is_covered_with_f_plus_1_pipelines(n0, f, extra):
    N = (f + 1) * n0 + extra
    hi = min(2 * n0 - 1, N - f * n0)
    for M in range((f + 1) * n0, N + 1):
        parts = decompose(M, n0, N, f)
        assert sum(parts) == M
        assert len(parts) >= f + 1
        assert all(n0 <= p <= hi for p in parts), (M, parts)


def test_decompose_rejects_counts_outside_the_range():
    with pytest.raises(ValueError):
        decompose(5, 3, 20, 1)


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


def test_sizes_are_feasible_range():
    prof = random_profile(random.Random(5), 10, 1, memory=400_000)
    spec = node_specification(prof, 12, 1)
    assert spec.template_sizes[0] == spec.n0
    assert max(spec.template_sizes) <= min(10, 12 - spec.n0)
