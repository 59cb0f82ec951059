"""The engine: builds a rank's stage from a plan and runs training steps.

- `schedule`: 1F1B as per-rank action lists, validator, printable grid (pure).
- `groups`: `Comm` (one world per generation, fresh store prefix) and `PlanGroups` (the plan's
  groups, deduplicated by rank set); destroy and rebuild in the same processes.
- `engine`: `Engine.step() -> StepResult` (failures as values), `TrainState`, `Reference`.
- `sampler`: the global sampler (same global batches whatever the plan).
- `optim`: AdamW, LR schedule, clipping (shared with the reference).
- `harness`: a reusable pool of worker processes for tests and benchmarks.

The engine reports failures; it never imports the elastic layer.
"""

from oobleck_hpc.engine.engine import Engine, Reference, StepResult, TrainState, reference_run
from oobleck_hpc.engine.groups import Comm, PlanGroups, default_backend

__all__ = ["Engine", "Reference", "reference_run", "StepResult", "TrainState", "Comm", "PlanGroups",
           "default_backend"]
