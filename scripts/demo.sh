#!/usr/bin/env bash
# The main job on the embedded local default. Usage: bash scripts/demo.sh [extra CLI args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
oobleck-hpc plan examples/gpt-tiny-local.yaml
oobleck-hpc run examples/gpt-tiny-local.yaml "$@"
