#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent, ~30 s on a fresh
# machine) and put it first on PATH. Sourced by demo.sh and test.sh, and safe to source in an
# interactive shell: the set-up runs in a subshell with its own strict options, so the caller's
# shell options stay as they were. Prints nothing when the environment is current.
_oobleck_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! (
    set -euo pipefail
    VENV="$_oobleck_root/.venv"
    PY="${PYTHON:-python3}"
    stamp="$VENV/.installed-$(sha256sum <"$_oobleck_root/pyproject.toml" | cut -c1-16)"
    if [ ! -f "$stamp" ]; then
        [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
        # torch first, pinned: this exact version is the CPU wheel that lies on the machine; an
        # open range would pull a multi-GB CUDA build.
        "$VENV/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
        # PYTHONWARNINGS: setuptools' notice that an editable install is one (BuildBackendWarning)
        PYTHONWARNINGS=ignore "$VENV/bin/pip" install -q -e "$_oobleck_root[test]" 2>&1 | grep -v '^WARNING: Location' || true
        "$VENV/bin/python" -c "import torch, h5py, yaml, tqdm, submitit, mpi4py, matplotlib, oobleck_hpc"
        rm -f "$VENV"/.installed-*
        touch "$stamp"
    fi
); then
    echo "scripts/env.sh: setting up $_oobleck_root/.venv failed (see above)" >&2
    unset _oobleck_root
    return 1 2>/dev/null || exit 1
fi
export PATH="$_oobleck_root/.venv/bin:$PATH"
unset _oobleck_root
