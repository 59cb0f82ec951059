"""State transfer after a reconfiguration: copy lost layers from surviving replicas, in place.

Input: the planner's transfer plan (`planning.reconfigure.transfer_plan(old, new, profile)`), a
tuple of `Transfer(layer, src_rank, dst_rank, nbytes)` with both ranks in the NEW plan's rank
space; the source's layers live in its BASE engine (the one that committed the last step), the
destination's in its NEW engine, which allocated the layers it receives uninitialised
(`Engine(receive=...)`).

One format: a layer's state is `checkpoint.layer_state(module, optimizer)` -- `param/<name>`,
`buffer/<name>`, `optim/<name>/<key>` (AdamW's exp_avg, exp_avg_sq, step) -- the dict that
checkpoints store and engines load. Both ends derive the layout from the model itself
(`expected_layout`): the destination knows its new layer's shapes, and whether optimizer state
exists follows from the training step (AdamW creates it at the first update; every survivor is
at the same step). The source checks that what it holds has exactly that layout before sending.

No staging copies: every tensor of the layout travels as itself -- the source sends its
parameters, buffers and AdamW moments directly, and the destination receives straight into its
new module's parameters and buffers and into freshly allocated moments in its new optimizer's
state. Only AdamW's `step` counters (scalars, on the CPU for the non-fused optimizer) travel
together in one small float64 tensor per layer on the communication device. So a transfer needs
no memory beyond the received layers themselves. The tensors a source sends are its base
engine's, unchanged until the new plan's first commit.

Every message is posted at once -- gloo: isend / irecv on the new world, one tag per tensor
(`layer * TAGS + i`); NCCL: one `batch_isend_irecv` group (no pair can deadlock) -- and then
waited with the collective timeout: a peer that dies during the transfer turns into an
exception here, and the caller starts a new round from the same base. The wait also ends as
soon as a newer membership round opens (the caller's `wait`: Comm.wait with the round as its
abort): a peer that stopped without breaking its connection (a hang, or a node whose loss
the agents noticed first) no longer holds this rank for the collective timeout -- a gloo
receive cannot be cancelled, so before this a transfer waited out its 5 s while the next
round's members were already waiting for this rank (chaos, seed 5199, trial 8). A peer that hung
with no round open (its node frozen: its agent is silent too) is named once the wait lasts a
stall's threshold (`peers`; recovery/stall.py, `watched`): its agent is probed, not waited for
until its lease expires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from oobleck_hpc.checkpoint import layer_state
from oobleck_hpc.planning.reconfigure import Transfer

ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")
MOMENTS = ("exp_avg", "exp_avg_sq")
TAGS = 4096
"""Tag space per layer (gloo): tensors of one layer are tagged layer * TAGS + their index."""


@dataclass
class TransferStats:
    sent_bytes: int = 0
    received_bytes: int = 0
    sent_layers: int = 0
    received_layers: int = 0
    seconds: float = 0.0


def peers(transfers: Sequence[Transfer], rank: int) -> list[int]:
    """The other ranks `rank` sends to or receives from (sorted): those its transfer waits on."""
    return sorted({t.dst_rank if t.src_rank == rank else t.src_rank for t in transfers
                   if rank in (t.src_rank, t.dst_rank)})


def expected_layout(module: torch.nn.Module, has_optim: bool) -> list[tuple[str, torch.Size]]:
    """(key, shape) of a layer's state, sorted by key, as the wire carries it."""
    out = [(k, v.shape) for k, v in layer_state(module, None).items()]
    if has_optim:
        for name, p in module.named_parameters():
            for key in ADAMW_KEYS:
                out.append((f"optim/{name}/{key}", torch.Size([]) if key == "step" else p.shape))
    return sorted(out)


def _messages(state: dict[str, torch.Tensor], layout: list[tuple[str, torch.Size]],
              device: torch.device) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors that travel for one layer, in layout order: every non-`step` entry as it
    is, then one float64 tensor of the `step` counters (names returned for unpacking)."""
    tensors = [state[k] for k, _ in layout if not k.endswith("/step")]
    steps = [k for k, _ in layout if k.endswith("/step")]
    if steps:
        tensors.append(torch.tensor([float(state[k]) for k in steps], dtype=torch.float64,
                                    device=device))
    return tensors, steps


def _outgoing(engine, layer: int, has_optim: bool, device: torch.device) -> list[torch.Tensor]:
    state = layer_state(engine.layers[layer], engine.optimizer)
    layout = expected_layout(engine.layers[layer], has_optim)
    if sorted(state) != [k for k, _ in layout]:
        raise RuntimeError(f"layer {layer}: state keys {sorted(state)} differ from the expected "
                           f"{[k for k, _ in layout]} (optimizer state present: {has_optim})")
    tensors, _ = _messages({k: v.detach() for k, v in state.items()}, layout, device)
    for t in tensors:
        if not t.is_contiguous() or t.device != device:
            raise RuntimeError(f"layer {layer}: a state tensor on {t.device} (contiguous: "
                               f"{t.is_contiguous()}) cannot be sent from {device}")
    return tensors


def _incoming(engine, layer: int, has_optim: bool, device: torch.device
              ) -> tuple[list[torch.Tensor], list[str]]:
    """Where layer `layer`'s state lands in the new engine: its module's own parameters and
    buffers, new AdamW moments put in place in its optimizer's state, and a buffer for the
    `step` counters (set by `_set_steps` once received)."""
    module = engine.layers[layer]
    layout = expected_layout(module, has_optim)
    state = {f"param/{n}": p.detach() for n, p in module.named_parameters()}
    state.update({k: v for k, v in layer_state(module, None).items() if k.startswith("buffer/")})
    if has_optim:
        for name, p in module.named_parameters():
            moments = {key: torch.empty_like(p, memory_format=torch.contiguous_format)
                       for key in MOMENTS}
            engine.optimizer.state[p] = moments
            state.update({f"optim/{name}/{key}": t for key, t in moments.items()})
            state[f"optim/{name}/step"] = torch.zeros(())
    return _messages(state, layout, device)


def _set_steps(engine, layer: int, steps: list[str], values: torch.Tensor) -> None:
    """AdamW's `step` counters of a received layer, where torch keeps them (on the CPU unless
    the optimizer is fused or capturable, as torch's own `Optimizer.load_state_dict` does)."""
    params = dict(engine.layers[layer].named_parameters())
    group = {id(p): g for g in engine.optimizer.param_groups for p in g["params"]}
    for key, value in zip(steps, values.cpu().tolist()):
        p = params[key.split("/")[1]]
        g = group[id(p)]
        on_param = g.get("fused", False) or g.get("capturable", False)
        engine.optimizer.state[p]["step"] = torch.tensor(
            value, dtype=torch.float32, device=p.device if on_param else "cpu")


def execute(transfers: Sequence[Transfer], rank: int, old_engine, new_engine,
            wait: Callable[[list[dist.Work]], None]) -> TransferStats:
    """Run this rank's part of the transfer plan (see module docstring); `wait` waits for
    the posted messages (Comm.wait: bounded, and given up when a newer round opens)."""
    t0 = time.perf_counter()
    has_optim = new_engine.state.step > 0
    device = new_engine.device
    nccl = dist.get_backend() == "nccl"
    stats = TransferStats()
    ops: list[tuple[str, torch.Tensor, int, int]] = []  # (isend|irecv, tensor, peer, tag)
    received: list[tuple[int, list[str], torch.Tensor]] = []
    for t in transfers:
        if t.src_rank == rank and t.dst_rank != rank:
            tensors = _outgoing(old_engine, t.layer, has_optim, device)
            ops += [("isend", x, t.dst_rank, t.layer * TAGS + i) for i, x in enumerate(tensors)]
            stats.sent_bytes += sum(x.numel() * x.element_size() for x in tensors)
            stats.sent_layers += 1
        elif t.dst_rank == rank:
            tensors, steps = _incoming(new_engine, t.layer, has_optim, device)
            ops += [("irecv", x, t.src_rank, t.layer * TAGS + i) for i, x in enumerate(tensors)]
            if steps:
                received.append((t.layer, steps, tensors[-1]))
            stats.received_bytes += sum(x.numel() * x.element_size() for x in tensors)
            stats.received_layers += 1
    if nccl and ops:
        works = dist.batch_isend_irecv([dist.P2POp(getattr(dist, op), x, peer)
                                        for op, x, peer, _ in ops])
    else:
        works = [dist.isend(x, dst=peer, tag=tag) if op == "isend" else
                 dist.irecv(x, src=peer, tag=tag) for op, x, peer, tag in ops]
    if works:
        wait(works)
    for layer, steps, values in received:
        _set_steps(new_engine, layer, steps, values)
    stats.seconds = time.perf_counter() - t0
    return stats
