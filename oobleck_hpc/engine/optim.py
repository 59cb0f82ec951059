"""Optimizer, learning-rate schedule and global-norm clipping shared by the engine and the
single-process reference (the same functions on both sides is what makes them comparable).

AdamW is element-wise, so one AdamW over the layers a rank owns is exactly the slice of one
AdamW over the whole model: per-layer optimizer state lives with the layer (and moves with it
on reconfiguration). Weight decay applies to matrices (dim >= 2) only, as in GPT-2/nanoGPT.
The fused implementation is used where the device supports it (CUDA, and CPU on torch >= 2.4),
else the foreach one.

LR: linear warm-up over `warmup_steps` to `lr` (step s uses lr * (s + 1) / warmup_steps), then
cosine decay to `min_lr` at the last step:

    lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup) / max(1, steps - warmup))) / 2

Clipping by the global norm ||g|| = sqrt(sum over layers of ||g_l||^2), each layer counted once
even though it lives on several ranks; gradients are scaled by min(1, clip / (||g|| + 1e-6)),
the same formula as torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from oobleck_hpc.config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    if train.warmup_steps > 0 and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor the gradients are multiplied by (1.0 when clipping is off or not needed)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def _fused_ok(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        try:
            p = nn.Parameter(torch.zeros(1))
            p.grad = torch.zeros(1)
            torch.optim.AdamW([p], fused=True).step()
            return True
        except (RuntimeError, TypeError):
            return False
    return False


def make_optimizer(modules: Iterable[nn.Module], train: TrainConfig,
                   device: torch.device) -> torch.optim.AdamW:
    """AdamW over the parameters of `modules` (in order), decay on matrices only."""
    decay, no_decay, seen = [], [], set()
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:  # a tensor shared by two modules (tied) is optimised once
                seen.add(id(p))
                (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": train.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    kwargs = {"fused": True} if _fused_ok(device) else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr_at(0, train), betas=tuple(train.betas), eps=1e-8,
                             **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
