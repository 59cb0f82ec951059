"""The interface every model implements: an ordered list of layers, each buildable on its own.

The layer is the unit the planner partitions and the engine places. Three rules make elastic
training simple:

1. `build_layer(i, device)` is deterministic in (seed, i): every replica of layer i starts
   bit-identical on every rank, with no broadcast, and a rank builds only the layers it owns.
2. `build_layer(i, "meta")` allocates nothing, so a 175B model can be described (shapes, bytes)
   on any machine without materialising it.
3. Shapes between layers are known in advance (`layer_output_shape`), so pipeline stages
   preallocate their send/receive buffers and exchange no metadata per step.

A user's own model: point the job's `model.factory` at `package.module:function`. The function
receives the job's `ModelConfig` and returns a `LayerModel` (subclass this class). The first layer
takes a batch of int64 token ids (B, T); the last returns logits (B, T, V); `loss` turns logits
and targets into one loss per sample. (`oobleck_hpc.models.base` re-exports `LayerModel` and
`layer_generator`, beside `build_model`.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LayerModel(ABC):
    name: str
    seed: int

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Tokens per sample the model is built for (position embeddings)."""

    @abstractmethod
    def build_layer(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Layer `index`, initialised deterministically from (self.seed, index)."""

    def empty_layer(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Layer `index` allocated on `device` without initialising it (its state is loaded
        next: a checkpoint, a transfer): `build_layer(i, "meta")` then `to_empty`. A layer with
        non-persistent buffers (computed when it is built, never part of its state: e.g. a
        cached mask) is built for real instead."""
        meta = self.build_layer(index, "meta")
        if any(m._non_persistent_buffers_set for m in meta.modules()):
            return self.build_layer(index, device)
        return meta.to_empty(device=device)

    @abstractmethod
    def layer_output_shape(self, index: int, batch_size: int, seq_len: int | None = None
                           ) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of layer `index`'s output for a batch (fp32 activations)."""

    @abstractmethod
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-sample loss, shape (B,): the mean over the sample's tokens."""

    @property
    def vocab_size(self) -> int:
        """The token ids the model takes are 0 .. vocab_size - 1: the last dimension of the last
        layer's logits. The job's data is checked against it before training (oobleck_hpc/data)."""
        shape, _ = self.layer_output_shape(self.num_layers - 1, 1)
        return shape[-1]

    def layer_names(self) -> list[str]:
        return [f"layer{i}" for i in range(self.num_layers)]

    def arch_hash(self) -> str:
        """Identifies the architecture in profile fingerprints."""
        return f"{type(self).__module__}.{type(self).__qualname__}:{self.num_layers}"

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        """Tensors that two layers share, as pairs ((layer i, parameter name), (layer j, name)),
        i < j (e.g. tied input and output embeddings). Each layer holds its own copy, built
        equal; the engine sums the copies' gradients over the holders of both layers before
        the step and counts the tensor once in the gradient norm, so the copies stay equal and
        training is that of the shared tensor. Default: none."""
        return []


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer `index`'s random stream: independent of every other layer."""
    return (seed * 1_000_003 + index * 7919 + 17) % (2**63 - 1)


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The random stream that initialises layer `index` (seeded with `layer_seed`)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(layer_seed(seed, index))
    return g


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample mean cross-entropy of next-token logits (B, T, V) against targets (B, T).
    At least fp32 (half-precision logits are upcast), never below the model's dtype: fp64 runs
    compare with references and must stay fp64 throughout."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return per_token.view(targets.shape).mean(dim=1)
