"""Tensors shared by two layers (`LayerModel.tied_parameters()`: tied input and output
embeddings), kept exact when the two layers live on different ranks -- Megatron's embedding
group, for any plan.

Each of the two layers holds its own copy; both start equal (the model builds them so). After
the step's per-layer all-reduces, every holder of layer i has G_i, the gradient of the mean
loss through copy i (summed over all its holders), and likewise G_j. The shared tensor's
gradient is G_i + G_j: the lowest holder of layer i contributes G_i, the lowest holder of
layer j contributes G_j, everyone else zeros, and ONE all-reduce (SUM) over the holders of
either layer (`union`, a group of `PlanGroups`) gives every holder of both copies the sum,
which it writes into each copy's gradient. Same gradient, same AdamW state, same update: the
copies stay equal, step after step, and a recovery that copies a layer from a surviving replica
copies an equal copy. The global gradient norm counts the tensor once: the rank that counts
layer j's segment leaves copy j's gradient out (`TiedGradients.square_norm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from oobleck_hpc.models.interface import LayerModel
from oobleck_hpc.planning.plan import Plan


def tied_layers(model: LayerModel) -> list[tuple[int, int]]:
    """The layer pairs (i, j) that share a tensor (`PlanGroups.build`'s `tied`)."""
    return [(i, j) for (i, _), (j, _) in model.tied_parameters()]


def union(plan: Plan, i: int, j: int) -> tuple[int, ...]:
    """The ranks holding layer i or layer j, sorted."""
    return tuple(sorted(set(plan.layer_owners(i)) | set(plan.layer_owners(j))))


@dataclass
class TiedTensor:
    """This rank's part in one shared tensor."""

    holders: tuple[int, ...]
    group: dist.ProcessGroup | None
    copies: list[nn.Parameter]
    """The copies this rank holds (one, or two when it holds both layers)."""
    contributed: list[nn.Parameter]
    """The copies whose (reduced) gradient this rank adds: it is their layer's lowest holder."""


@dataclass
class TiedGradients:
    """The shared tensors of the layers a rank holds (module docstring)."""

    tensors: list[TiedTensor]
    uncounted: list[nn.Parameter]
    """Second copies whose gradient this rank must leave out of the norm."""

    @classmethod
    def build(cls, model: LayerModel, plan: Plan, rank: int, layers: dict[int, nn.Module],
              group: Callable[[tuple[int, ...]], dist.ProcessGroup | None]) -> TiedGradients:
        tensors, uncounted = [], []
        for (i, a), (j, b) in model.tied_parameters():
            held = [(layer, name) for layer, name in ((i, a), (j, b)) if layer in layers]
            if not held:
                continue
            holders = union(plan, i, j)
            g = group(holders)
            if g is None and len(holders) > 1:
                raise ValueError(f"layers {i} and {j} share a tensor but the plan's groups have "
                                 f"none for their holders {holders}: build them with "
                                 f"PlanGroups.build(plan, comm, tied=tied_layers(model))")
            copies = [layers[layer].get_parameter(name) for layer, name in held]
            lowest = [layers[layer].get_parameter(name) for layer, name in held
                      if plan.layer_owners(layer)[0] == rank]
            tensors.append(TiedTensor(holders, g, copies, lowest))
            if j in layers and plan.layer_owners(j)[0] == rank:
                uncounted.append(layers[j].get_parameter(b))
        return cls(tensors, uncounted)

    @staticmethod
    def reduce(t: TiedTensor, wait: Callable[[dist.Work], None]) -> None:
        """Sum the shared tensor's gradient over the holders of both copies (after the
        per-layer all-reduces completed); `wait(work)` waits for the collective."""
        total = torch.zeros_like(t.copies[0].grad)
        for p in t.contributed:
            total += p.grad
        if t.group is not None:
            wait(dist.all_reduce(total, op=dist.ReduceOp.SUM, group=t.group, async_op=True))
        for p in t.copies:
            p.grad.copy_(total)

    def square_norm(self, flat: torch.Tensor, modules: Sequence[nn.Module]) -> torch.Tensor:
        """||g||^2 (fp64) of a segment's flat gradient buffer (the gradients of `modules`'
        parameters, in order), the second copies of shared tensors left out. Computed in the
        buffer's dtype with fp32 accumulation at least: no copy."""
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        parts, start, offset = [], 0, 0
        for p in (p for m in modules for p in m.parameters()):
            if any(p is u for u in self.uncounted):
                parts.append(flat[start:offset])
                start = offset + p.numel()
            offset += p.numel()
        parts.append(flat[start:])
        return sum((torch.linalg.vector_norm(x, dtype=acc).double().square()
                    for x in parts if x.numel()), torch.zeros((), dtype=torch.float64,
                                                            device=flat.device))
