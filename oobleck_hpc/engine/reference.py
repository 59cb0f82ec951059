"""The single-process reference: the same global batches through the whole model with the same
optimizer, microbatch by microbatch, in one process -- no plan, no pipeline, no reduction, no
transfer. What the engine and every recovery must equal (`oobleck-hpc chaos`, the tests, the
engine benchmark); it shares with the engine only the sampler, the optimizer and the schedule
of engine/optim.py, so a bug of the distributed path cannot hide in it. A tensor two layers
share (`LayerModel.tied_parameters`) is ONE parameter here, as in the original model: the
engine's two copies must equal it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oobleck_hpc.config import JobConfig
from oobleck_hpc.engine.state import TrainState
from oobleck_hpc.engine.optim import lr_at, make_optimizer, set_lr
from oobleck_hpc.engine.sampler import Dataset, GlobalSampler
from oobleck_hpc.models.base import LayerModel


@dataclass
class Reference:
    """The single-process reference (module docstring)."""

    job: JobConfig
    model: LayerModel
    dataset: Dataset
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.layers = [self.model.build_layer(i, self.device) for i in range(self.model.num_layers)]
        for (i, a), (j, b) in self.model.tied_parameters():  # one tensor, as in the model
            holder, _, attr = b.rpartition(".")
            setattr(self.layers[j].get_submodule(holder), attr, self.layers[i].get_parameter(a))
        self.optimizer = make_optimizer(self.layers, self.job.train, self.device)
        self.sampler = GlobalSampler(self.dataset, self.job.train.microbatch_size,
                                     self.job.train.global_microbatches, seed=self.job.model.seed)
        self.state = TrainState()
        self.params = list({id(p): p for m in self.layers for p in m.parameters()}.values())

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        total = 0.0
        bf16 = self.job.model.dtype == "bfloat16"
        for g in range(self.job.train.global_microbatches):
            x, y = self.sampler.microbatch(self.state.cursor, g)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                h = x.to(self.device)
                for m in self.layers:
                    h = m(h)
            loss = self.model.loss(h, y.to(self.device)).sum()
            total += float(loss.detach())
            (loss / self.sampler.global_batch).backward()
        if self.job.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.job.train.grad_clip)
        set_lr(self.optimizer, lr_at(self.state.step, self.job.train))
        self.optimizer.step()
        self.state.step += 1
        self.state.cursor += self.sampler.global_batch
        return total / self.sampler.global_batch


def reference_run(job: JobConfig, steps: int, dtype: torch.dtype = torch.float64
                  ) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """`steps` steps of the single-process `Reference` for `job`, built in `dtype` (default
    float64: the exactness checks of the engine and of every recovery compare against it).
    Returns the per-step losses and each layer's final parameters."""
    from oobleck_hpc.data import dataset_for
    from oobleck_hpc.models.base import build_model

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(job.model)
        ref = Reference(job, model, dataset_for(job.data, model, job.source))
        losses = [ref.step() for _ in range(steps)]
        params = {i: {n: p.detach().clone() for n, p in m.named_parameters()}
                  for i, m in enumerate(ref.layers)}
    finally:
        torch.set_default_dtype(old)
    return losses, params
