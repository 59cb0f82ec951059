#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent, ~30 s on a fresh
# machine) and put it first on PATH. Sourced by demo.sh and test.sh, and safe to source in an
# interactive shell: the set-up runs in a subshell with its own strict options, so the caller's
# shell options stay as they were. Prints nothing when the environment is current; while it
# sets it up, one line per phase on stderr (stdout stays the caller's).
_oobleck_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! (
    set -euo pipefail
    VENV="$_oobleck_root/.venv"
    PY="${PYTHON:-python3}"
    TORCH="torch==${TORCH_VERSION:-2.13.0}"
    stamp="$VENV/.installed-$(sha256sum <"$_oobleck_root/pyproject.toml" | cut -c1-16)"
    SECONDS=0  # this subshell's own clock (an interactive shell's counts since it started)
    say() { echo "scripts/env.sh [${SECONDS} s]: $*" >&2; }
    if [ ! -f "$stamp" ]; then
        if [ -x "$VENV/bin/python" ]; then
            say "updating $VENV (pyproject.toml changed since it was set up)"
        else
            say "creating the virtual environment $VENV ($PY -m venv, then the latest pip)"
            "$PY" -m venv "$VENV"
        fi
        "$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
        # torch first, pinned: this exact version is the CPU wheel that lies on the machine; an
        # open range would pull a multi-GB CUDA build. A GPU node's CUDA build: TORCH_INDEX_URL
        # (e.g. https://download.pytorch.org/whl/cu128) and TORCH_VERSION (slurm/README.md).
        say "installing $TORCH${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (the largest step)"
        "$VENV/bin/pip" install -q "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} 2>&1 | grep -v '^WARNING: Location' || true
        say "installing oobleck_hpc (editable) and its dependencies: numpy, h5py, pyyaml, tqdm, submitit, mpi4py, the Open MPI wheel, matplotlib; pytest for the tests"
        # PYTHONWARNINGS: setuptools' notice that an editable install is one (BuildBackendWarning)
        PYTHONWARNINGS=ignore "$VENV/bin/pip" install -q -e "$_oobleck_root[test]" 2>&1 | grep -v '^WARNING: Location' || true
        say "checking that torch, h5py, yaml, tqdm, submitit, mpi4py, matplotlib and oobleck_hpc import"
        "$VENV/bin/python" -c "import torch, h5py, yaml, tqdm, submitit, mpi4py, matplotlib, oobleck_hpc"
        rm -f "$VENV"/.installed-*
        touch "$stamp"
        say "$VENV is ready"
    fi
); then
    echo "scripts/env.sh: setting up $_oobleck_root/.venv failed (see above)" >&2
    unset _oobleck_root
    return 1 2>/dev/null || exit 1
fi
export PATH="$_oobleck_root/.venv/bin:$PATH"
unset _oobleck_root
