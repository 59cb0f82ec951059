#!/usr/bin/env bash
# The whole test suite, on a fresh machine: environment, lint and types, local Slurm cluster,
# pytest. Usage: bash scripts/test.sh [--quick] [pytest args]
# --quick: lint, types and tests/unit/ only (everything that starts no process; about a minute
# on 2 cores): no cluster, no optional extra installed (its tests skip where it is absent).
# OOBLECK_SLURM_TESTS=0 skips the cluster (tests/test_slurm_*.py then skip themselves).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
# ruff (pyflakes' checks and more) on everything, mypy on the planner and the control plane
# (their settings: pyproject.toml); a finding fails the run before any test starts.
ruff check --quiet .
mypy
if [ "${1:-}" = "--quick" ]; then
    shift
    exec python -m pytest -q tests/unit "$@"
fi
# The optional Hugging Face extra is tested too (tests that need it skip where it is absent):
# installed once, one import check afterwards.
if ! python -c "import tokenizers, transformers, safetensors" 2>/dev/null; then
    echo "scripts/test.sh: installing the optional extra hf (transformers, safetensors, tokenizers)" >&2
    PYTHONWARNINGS=ignore python -m pip install -q -e ".[test,hf]"
fi
if [ "${OOBLECK_SLURM_TESTS:-1}" = 1 ]; then
    # A real Slurm controller + 4 slurmd on this machine (installs slurm-wlm once, ~15 s; then
    # ~2 s), torn down on exit whatever pytest's outcome.
    trap 'slurm/dev-cluster.sh down' EXIT
    slurm/dev-cluster.sh up
    eval "$(slurm/dev-cluster.sh env)"
    export OOBLECK_REQUIRE_SLURM=1   # a cluster that did not come up fails the Slurm tests
fi
python -m pytest -q -ra --durations=15 "$@"   # the 15 slowest: what the wait is spent on
