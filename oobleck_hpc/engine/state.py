"""What a training step returns (`StepResult`: a value, failed or not) and what advances when it
commits (`TrainState`): the engine's small public types, shared with the reference, the elastic
layer and the checkpoints; and the wait a running step is in (`Waiting`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TrainState:
    """What advances when a step commits (and what a checkpoint stores besides the layers)."""

    step: int = 0
    cursor: int = 0
    """Samples of the global stream consumed so far."""


@dataclass
class StepResult:
    step: int
    ok: bool
    loss: float = math.nan
    """Mean loss over the global batch (same value on every rank)."""
    grad_norm: float = math.nan
    lr: float = math.nan
    samples: int = 0
    seconds: float = 0.0
    compute_s: float = 0.0
    """This rank's time in its forward and backward computations (not waiting for peers): what
    a straggler's node is slow at (recovery/straggler.py). On GPUs the GPU's time
    (engine/clock.py: CUDA events), not the host's time to launch the kernels."""
    error: BaseException | None = None
    phase: str | None = None
    """Where it failed: forward, backward, gradient_sync or optimizer."""
    peer: int | None = None
    """The rank the failing transfer talked to (None for collectives and compute)."""
    group: tuple[int, ...] | None = None
    """The ranks of the failing collective."""


@dataclass(frozen=True)
class Waiting:
    """A communication wait of a step in progress (`Engine.waiting`), read on another thread by
    the elastic layer's stall watch (recovery/stall.py): a peer that never arrives is found in
    band, long before the collective timeout or the agents' lease."""

    since: float
    """time.monotonic() when the wait began."""
    phase: str
    ranks: tuple[int, ...]
    """The ranks waited on: the transfer's peer, or the collective's group (the world's for the
    final all-reduce)."""
