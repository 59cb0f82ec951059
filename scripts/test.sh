#!/usr/bin/env bash
# The whole test suite, on a fresh machine: environment, local Slurm cluster, pytest.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
python -m pytest -q -ra "$@"
