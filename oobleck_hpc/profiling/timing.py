"""What every measurement of the profiler shares: its options, the random token range, the
forward/backward timer (CUDA events on a GPU, `time.perf_counter` on a CPU), median and
interquartile range, byte counts of unique tensor storages, and the torch thread setting on a CPU."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

TOKEN_RANGE = 256  # random input tokens lie below the byte vocabulary: valid for every model


@dataclass(frozen=True)
class ProfilerOptions:
    warmup: int = 3
    """Untimed iterations per layer before measuring."""
    repeats: int = 10
    """Timed iterations per layer (median and interquartile range kept)."""
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
    """Message sizes (bytes) of the link measurements."""
    comm_repeats: int = 8
    comm_procs: int = 2
    """Processes for the link measurement (all-reduce participants); at least 2."""
    comm_timeout_s: float = 120.0
    cpu_threads: int = 1
    """Torch threads on CPU: what one CPU worker of the engine gets (the local launcher sets
    OMP_NUM_THREADS=1 so the workers of a node share its cores)."""
    sharing_levels: int = 6
    """CPU: measure `core_sharing` for 1 .. this many workers per core (0 skips it)."""
    sharing_max_procs: int = 48
    """CPU: at most this many processes for the core-sharing measurement (fewer levels on a
    host with many cores)."""
    sharing_seconds: float = 0.6
    """CPU: how long every level of the core-sharing measurement runs."""


def median_iqr(xs: list[float]) -> tuple[float, float]:
    """(median, interquartile range) of timings."""
    q = np.percentile(np.asarray(xs), [25, 50, 75])
    return float(q[1]), float(q[2] - q[0])


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the storage under a tensor (views of one storage share it)."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def tensor_bytes(ts) -> int:
    """Bytes of the unique storages under the tensors of `ts` (other items are skipped)."""
    seen = {}
    for t in ts:
        if isinstance(t, torch.Tensor):
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Timer:
    """Forward/backward timing: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fwd: Callable[[], torch.Tensor], bwd: Callable[[torch.Tensor], None]) -> tuple[float, float]:
        if self.cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            out = fwd()
            e1.record()
            bwd(out)
            e2.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1), e1.elapsed_time(e2)
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        bwd(out)
        t2 = time.perf_counter()
        return 1000 * (t1 - t0), 1000 * (t2 - t1)


@contextlib.contextmanager
def torch_threads(device: torch.device, threads: int):
    """Run the block with `threads` torch threads on a CPU device (no-op on a GPU)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)

