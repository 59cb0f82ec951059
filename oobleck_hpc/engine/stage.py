"""What one rank holds of a plan: its layers, their gradient segments, its transfer buffers.

Layers [layer_start, layer_end) of the rank's stage come from one of three places
(`build_layers`): another engine's modules, taken over as they are (a reconfiguration's kept
layers); an uninitialised allocation (`model.empty_layer`) for a layer whose state a checkpoint
or a transfer will write; or built fresh from (seed, layer index).

A segment (`make_segments`) is a run of consecutive layers with the same holder set
(`plan.layer_owners`): one flat gradient buffer (the parameters' `.grad` are views of it, as
DDP's gradient_as_bucket_view), one all-reduce over that rank set (engine/engine.py, step 2).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from oobleck_hpc.engine.groups import PlanGroups
from oobleck_hpc.models.base import LayerModel
from oobleck_hpc.planning.plan import Plan


@dataclass
class Segment:
    """Consecutive layers of this rank's stage with the same holder set: one flat gradient
    buffer, one all-reduce."""

    layers: list[int]
    modules: list[nn.Module]
    owners: tuple[int, ...]
    group: dist.ProcessGroup | None
    flat: torch.Tensor
    counts_norm: bool
    """This rank is the lowest holder: it adds the segment's squared norm to the global norm."""
    work: dist.Work | None = None
    recompute: bool = False
    """train.recompute: each layer keeps only its input for backward, which runs its forward
    again first (torch.utils.checkpoint; no dropout, so the same values, bit for bit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.modules:
            x = checkpoint(m, x, use_reentrant=False) if self.recompute else m(x)
        return x

    def start_all_reduce(self) -> None:
        """Post the SUM all-reduce of the segment's gradients over its holders (`work`); a
        segment held by this rank alone has no group and nothing to reduce."""
        if self.group is not None:
            self.work = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=self.group,
                                        async_op=True)


def build_layers(model: LayerModel, layers: range, device: torch.device,
                 adopted: Mapping[int, nn.Module], loaded: Collection[int]) -> dict[int, nn.Module]:
    """The modules of `layers`: adopted ones as they are, the `loaded` ones (state from a
    checkpoint or a transfer) allocated uninitialised, the others built fresh."""
    out: dict[int, nn.Module] = {}
    for layer in layers:
        if layer in adopted:
            out[layer] = adopted[layer]
        elif layer in loaded:
            out[layer] = model.empty_layer(layer, device)
        else:
            out[layer] = model.build_layer(layer, device)
    return out


def make_segments(layers: Mapping[int, nn.Module], plan: Plan, rank: int, groups: PlanGroups,
                  dtype: torch.dtype, device: torch.device, recompute: bool) -> list[Segment]:
    """`layers` (consecutive, in order) cut into segments, each with its flat gradient buffer
    allocated and its parameters' `.grad` pointing into it."""
    segments: list[Segment] = []
    for layer, module in layers.items():
        owners = plan.layer_owners(layer)
        if segments and segments[-1].owners == owners:
            segments[-1].layers.append(layer)
            segments[-1].modules.append(module)
        else:
            segments.append(Segment([layer], [module], owners, groups.group(owners),
                                    torch.empty(0), counts_norm=rank == owners[0],
                                    recompute=recompute))
    for seg in segments:
        params = [p for m in seg.modules for p in m.parameters()]
        # empty, not zeros: every step zeroes it first (Engine._pipeline), and an untouched
        # allocation costs nothing until then
        seg.flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = seg.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return segments


def transfer_buffers(model: LayerModel, layers: range, rows: tuple[int, int], seq_len: int,
                     slots: int, first: bool, last: bool, dtype: torch.dtype,
                     device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The stage's preallocated receive buffers for its `rows` of each microbatch: `slots`
    activation buffers (the 1F1B in-flight bound; none on the first stage) and one gradient
    buffer (none on the last). Shapes come from the model: no shapes travel at run time."""
    n_rows = rows[1] - rows[0]
    act_slots: list[torch.Tensor] = []
    if not first and n_rows:
        shape, _ = model.layer_output_shape(layers.start - 1, n_rows, seq_len)
        act_slots = [torch.empty(shape, dtype=dtype, device=device) for _ in range(slots)]
    grad_buf: torch.Tensor | None = None
    if not last and n_rows:
        shape, _ = model.layer_output_shape(layers.stop - 1, n_rows, seq_len)
        grad_buf = torch.empty(shape, dtype=dtype, device=device)
    return act_slots, grad_buf
