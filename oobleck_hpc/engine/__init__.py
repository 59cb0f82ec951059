"""The engine: builds a rank's stage from a plan and runs training steps.

- `schedule`: 1F1B as per-rank action lists, validator, printable grid (pure).
- `groups`: `Comm` (one world per generation, fresh store prefix) and `PlanGroups` (the plan's
  groups, deduplicated by rank set); destroy and rebuild in the same processes.
- `engine`: `Engine.step() -> StepResult` (failures as values).
- `stage`: what a rank holds: its layers (adopted, allocated or built), gradient segments and
  transfer buffers.
- `clock`: `ComputeClock`, a rank's forward and backward time in a step (GPU time on CUDA).
- `state`: `StepResult`, `TrainState`, `Waiting` (the communication a running step waits for).
- `reference`: `Reference`, `reference_run`: the single-process run every result must equal.
- `sampler`: the global sampler (same global batches whatever the plan).
- `optim`: AdamW, LR schedule, clipping (shared with the reference).
- `tied`: a tensor two layers share (tied embeddings): both copies' gradients summed.

The engine reports failures; it never imports the elastic layer.
"""

from oobleck_hpc.engine.engine import Engine
from oobleck_hpc.engine.state import StepResult, TrainState
from oobleck_hpc.engine.groups import Comm, PlanGroups, default_backend
from oobleck_hpc.engine.reference import Reference, reference_run

__all__ = ["Engine", "Reference", "reference_run", "StepResult", "TrainState", "Comm", "PlanGroups",
           "default_backend"]
