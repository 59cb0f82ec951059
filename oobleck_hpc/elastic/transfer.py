"""State transfer after a reconfiguration: copy lost layers from surviving replicas.

Input: the planner's transfer plan (`planning.reconfigure.transfer_plan(old, new, profile)`), a
tuple of `Transfer(layer, src_rank, dst_rank, nbytes)` with both ranks in the NEW plan's rank
space; the source's layers live in its OLD engine (the one that committed the last step), the
destination's in its NEW engine (built for the new plan, kept layers already loaded locally).

One format: a layer's state is `checkpoint.layer_state(module, optimizer)` -- `param/<name>`,
`buffer/<name>`, `optim/<name>/<key>` (AdamW's exp_avg, exp_avg_sq, step) -- the dict that
checkpoints store. On the wire it is one flat tensor per (layer, destination) in the parameters'
dtype, the entries in sorted key order (AdamW's `step` is an integer-valued float: exact). Both
ends derive the layout from the model itself (`expected_layout`): the destination knows its new
layer's parameter shapes, and whether optimizer state exists follows from the training step
(AdamW creates it at the first update; every survivor is at the same step). The source checks
that what it holds has exactly that layout before sending.

Every transfer is posted at once (isend / irecv on the new world, tag = layer) and then waited
with the collective timeout: a peer that dies during the transfer turns into an exception here,
and the caller starts a new round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from oobleck_hpc.checkpoint import layer_state, load_layer_state
from oobleck_hpc.planning.reconfigure import Transfer

ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class TransferStats:
    sent_bytes: int = 0
    received_bytes: int = 0
    sent_layers: int = 0
    received_layers: int = 0
    seconds: float = 0.0


def expected_layout(module: torch.nn.Module, has_optim: bool) -> list[tuple[str, torch.Size]]:
    """(key, shape) of a layer's state, sorted by key, as the wire carries it."""
    out = [(k, v.shape) for k, v in layer_state(module, None).items()]
    if has_optim:
        for name, p in module.named_parameters():
            for key in ADAMW_KEYS:
                out.append((f"optim/{name}/{key}", torch.Size([]) if key == "step" else p.shape))
    return sorted(out)


def pack(module: torch.nn.Module, optimizer: torch.optim.Optimizer, has_optim: bool,
         dtype: torch.dtype, device: torch.device, layer: int) -> torch.Tensor:
    state = layer_state(module, optimizer)
    layout = expected_layout(module, has_optim)
    if sorted(state) != [k for k, _ in layout]:
        raise RuntimeError(f"layer {layer}: state keys {sorted(state)} differ from the expected "
                           f"{[k for k, _ in layout]} (optimizer state present: {has_optim})")
    return torch.cat([state[k].detach().to(device=device, dtype=dtype).reshape(-1)
                      for k, _ in layout])


def unpack(flat: torch.Tensor, layout: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, shape in layout:
        n = shape.numel()
        out[key] = flat[offset:offset + n].view(shape)
        offset += n
    if offset != flat.numel():
        raise RuntimeError(f"transfer buffer has {flat.numel()} elements, layout needs {offset}")
    return out


def execute(transfers: Sequence[Transfer], rank: int, old_engine, new_engine,
            timeout) -> TransferStats:
    """Run this rank's part of the transfer plan (see module docstring)."""
    import time

    t0 = time.perf_counter()
    has_optim = new_engine.state.step > 0
    dtype, device = new_engine.dtype, new_engine.device
    stats = TransferStats()
    works: list[tuple[dist.Work, int]] = []
    incoming: list[tuple[int, torch.Tensor, list]] = []
    keep_alive: list[torch.Tensor] = []
    for t in transfers:
        if t.src_rank == rank and t.dst_rank != rank:
            flat = pack(old_engine.layers[t.layer], old_engine.optimizer, has_optim, dtype,
                        device, t.layer)
            keep_alive.append(flat)
            works.append((dist.isend(flat, dst=t.dst_rank, tag=t.layer), t.dst_rank))
            stats.sent_bytes += flat.numel() * flat.element_size()
            stats.sent_layers += 1
        elif t.dst_rank == rank:
            layout = expected_layout(new_engine.layers[t.layer], has_optim)
            flat = torch.empty(sum(s.numel() for _, s in layout), dtype=dtype, device=device)
            works.append((dist.irecv(flat, src=t.src_rank, tag=t.layer), t.src_rank))
            incoming.append((t.layer, flat, layout))
    for work, _peer in works:
        work.wait(timeout)
    for layer, flat, layout in incoming:
        load_layer_state(new_engine.layers[layer], new_engine.optimizer, unpack(flat, layout),
                         layer=layer)
        stats.received_bytes += flat.numel() * flat.element_size()
        stats.received_layers += 1
    stats.seconds = time.perf_counter() - t0
    return stats
