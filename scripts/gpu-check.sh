#!/usr/bin/env bash
# The CUDA/NCCL checks (tests/test_gpu.py): the compute clock and a one-node run on one GPU;
# with 2+ GPUs engine equivalence and in-place recovery over NCCL, one pretend node per GPU,
# against the fp64 reference. Needs a CUDA GPU and a CUDA build of torch: on a GPU machine `TORCH_VERSION=2.13.0 bash scripts/gpu-check.sh` takes PyPI's default
# (CUDA) wheel when .venv is created there. Without a GPU it says why and exits 0 (nothing ran).
# Usage: bash scripts/gpu-check.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
if ! why="$(python - <<'PY'
import sys
import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
if gpus < 1 or not nccl:
    print(f"torch {torch.__version__}: {gpus} CUDA GPU(s), NCCL "
          f"{'available' if nccl else 'not available'}; the checks need a GPU and NCCL")
    sys.exit(1)
print(f"torch {torch.__version__}, {gpus} GPUs: {torch.cuda.get_device_name(0)}")
PY
)"; then
    echo "gpu-check: skipped, nothing ran: $why"
    exit 0
fi
echo "gpu-check: $why"
python -m pytest -q -ra -m gpu tests/test_gpu.py "$@"
