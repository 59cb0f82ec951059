#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent, ~30 s on a fresh
# machine). Sourced by demo.sh and test.sh; prints nothing when the environment is current.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
    # torch first, pinned: this exact version is the CPU wheel that lies on the machine; an open
    # range would pull a multi-GB CUDA build.
    "$VENV/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
    "$VENV/bin/pip" install -q -e "$ROOT[test]" 2>&1 | grep -v '^WARNING: Location' || true
    "$VENV/bin/python" -c "import torch, h5py, yaml, tqdm, submitit, mpi4py, oobleck_hpc" 
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
