"""A GPT as a layer list, in plain torch.

Layer 0: token + position embedding. Layers 1..n_layer: pre-norm transformer blocks (causal
self-attention, GELU MLP). Layer n_layer + 1: final LayerNorm + LM head (no weight tying: layers
are independent units that may live on different ranks). No dropout, so a step is a pure function
of (weights, batch) and the engine can be checked against a single-process reference exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_hpc.models.interface import LayerModel, causal_lm_loss, layer_generator
from oobleck_hpc.models.configs import GPTConfig

INIT_STD = 0.02


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class GPT(LayerModel):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        self.cfg = cfg
        self.name = cfg.name
        self.seed = seed

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    def layer_names(self) -> list[str]:
        return ["embedding"] + [f"block{i}" for i in range(self.cfg.n_layer)] + ["head"]

    def arch_hash(self) -> str:
        return self.cfg.arch_hash()

    def _module(self, index: int) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"{self.name} has layers 0..{self.num_layers - 1}, not {index}")
        if index == 0:
            return Embedding(self.cfg)
        if index == self.num_layers - 1:
            return Head(self.cfg)
        return Block(self.cfg)

    def build_layer(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        with torch.device("meta"):
            module = self._module(index)
        if torch.device(device).type == "meta":
            return module
        module = module.to_empty(device=device)
        self._init(module, layer_generator(self.seed, index))
        return module

    def _init(self, module: nn.Module, gen: torch.Generator) -> None:
        # GPT-2 init: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer).
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif name.startswith("ln"):
                    p.fill_(1.0)
                else:
                    std = resid_std if name in ("proj.weight", "out.weight") else INIT_STD
                    # Draw on the CPU from the layer's own stream, then copy: same values on any device.
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def layer_output_shape(self, index: int, batch_size: int, seq_len: int | None = None
                           ) -> tuple[tuple[int, ...], torch.dtype]:
        t = seq_len or self.cfg.seq_len
        if index == self.num_layers - 1:
            return (batch_size, t, self.cfg.vocab_size), torch.float32
        return (batch_size, t, self.cfg.d_model), torch.float32

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(logits, targets)
