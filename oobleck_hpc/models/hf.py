"""Hugging Face causal LMs as layer lists: the only module that imports transformers.

`HFModel(directory)` reads `directory`/config.json (its sizes: `models/hf_config.py`) and cuts
the architecture's own transformers model into the layers the planner and the engine place:

    layer 0              Embedding: the input embeddings (+ gpt2's learned positions)
    layers 1..n_layer    Block: decoder block i, with its own copy of the rotary embedding
                         (buffers only): position ids and (cos, sin) are rebuilt inside the
                         layer, and the attention is causal by itself (sdpa's is_causal, no
                         mask passed), so a layer builds and runs on its own
    last layer           Head: final norm + LM head (logits; `loss` as our GPT's)

Nothing is re-implemented: attention, RoPE, RMSNorm, SwiGLU, GQA are transformers' modules,
taken from the model built on the `meta` device (`AutoModelForCausalLM.from_config`, attention
"sdpa": with no mask it attends causally, as the whole model does without padding), copied,
then allocated and initialised by the model's own `_init_weights` under the layer's seeded RNG
(`layer_generator`'s seed): deterministic in (seed, index), on any device (drawn on the CPU).
Dropout is turned off (every `*dropout` / `*pdrop` of the config set to 0): a step is a pure
function of weights and batch, which exact recovery relies on.

Names: a layer's parameters are named after the wrapper's part (`embed.`, `positions.`,
`block.`, `norm.`, `lm_head.`) followed by the Hugging Face module's own names; `hf_names(i)`
maps them to the full state-dict names (`model.layers.3.self_attn.q_proj.weight`), so loading
`save_pretrained` weights per layer, and exporting back, is a plain name mapping.

Norms in float64: transformers' RMSNorm (llama, mistral, qwen2) computes in float32 whatever
the model's dtype, which upcasts bf16/fp16 but *rounds* an fp64 model's hidden states to 24
bits: rounding-order noise of 1e-16 (another micro-batch grouping, another all-reduce order)
then flips float32 roundings and grows to ~1e-6 in a few hundred steps, which no exactness check
of a recovery can tell from a bug. `precise_norms` gives those norms torch's own `rms_norm` in
the input's dtype when it is float64, and leaves every other dtype to transformers' code; the
layers have it, and the tests apply it to the reference model they compare with.

Tied embeddings (gpt2; small Llamas and Qwens with tie_word_embeddings): the first and the
last layer each hold a copy of the one tensor, both initialised from layer 0's stream;
`tied_parameters()` tells the engine, which sums the two copies' gradients over the holders of
both layers before the step and counts the tensor once in the gradient norm (engine/tied.py).
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.models.hf_config import HFArch, check_transformers_version, hf_arch
from oobleck_hpc.models.interface import LayerModel, causal_lm_loss, layer_seed

ATTENTION = "sdpa"


def _transformers(source: str):
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(source, "model.hf", f"needs the transformers package ({e})",
                          "install the extra: pip install 'oobleck_hpc[hf]'") from e
    check_transformers_version(transformers.__version__, source)
    return transformers


def _rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float64:
        return type(self).forward(self, x)
    return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)


def precise_norms(module: nn.Module) -> nn.Module:
    """Float64 RMSNorms in float64 (module docstring); returns `module`."""
    for m in module.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_rms_norm, m)
    return module


class Embedding(nn.Module):
    """Layer 0: token ids (B, T) -> hidden states (B, T, d)."""

    def __init__(self, embed: nn.Module, positions: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.positions = positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return h


class Block(nn.Module):
    """One decoder block; rotary tables from its own copy of the rotary embedding."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.block = block
        self.rotary = rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            return self.block(h)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return self.block(h, attention_mask=None, position_ids=position_ids,
                          position_embeddings=self.rotary(h, position_ids))


class Head(nn.Module):
    """Final norm + LM head: hidden states -> logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


class HFModel(LayerModel):
    """A Hugging Face causal LM of `directory`/config.json as a layer list (module docstring)."""

    def __init__(self, directory: str | Path, name: str | None = None, seed: int = 0,
                 source: str = "<job>", weights: str | Path | None = None):
        self.directory = Path(directory)
        self.arch: HFArch = hf_arch(directory, source)
        self.name = name or self.directory.name
        self.seed = seed
        self.source = source
        auto = _transformers(source).AutoConfig
        self.config = auto.from_pretrained(str(self.directory), local_files_only=True)
        for key, value in self.config.to_dict().items():  # no dropout (module docstring)
            if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
                setattr(self.config, key, 0.0)
        self._meta_models: dict[torch.dtype, nn.Module] = {}
        self.weights = None
        if weights is not None:  # pretrained: every fresh layer is read from them
            from oobleck_hpc.models.hf_weights import Weights

            self.weights = Weights(weights, source)

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def seq_len(self) -> int:
        return self.arch.max_positions

    def layer_names(self) -> list[str]:
        return ["embedding"] + [f"block{i}" for i in range(self.arch.n_layer)] + ["head"]

    def arch_hash(self) -> str:
        return self.arch.arch_hash()

    # ------------------------------------------------------------------ the layers

    def meta_model(self) -> nn.Module:
        """The whole transformers model on the meta device, in the default dtype (no memory)."""
        dtype = torch.get_default_dtype()
        if dtype not in self._meta_models:
            auto = _transformers(self.source).AutoModelForCausalLM
            with torch.device("meta"):
                self._meta_models[dtype] = auto.from_config(self.config, dtype=dtype,
                                                            attn_implementation=ATTENTION)
        return self._meta_models[dtype]

    @property
    def _last(self) -> int:
        return self.num_layers - 1

    def _parts(self, index: int) -> dict[str, str]:
        """The wrapper's parts of layer `index` -> their Hugging Face module paths."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"{self.name} has layers 0..{self.num_layers - 1}, not {index}")
        p = self.arch.parts
        if index == 0:
            return {"embed": p.embed, **({"positions": p.positions} if p.positions else {})}
        if index == self._last:
            return {"norm": p.norm, "lm_head": p.head}
        return {"block": f"{p.blocks}.{index - 1}", **({"rotary": p.rotary} if p.rotary else {})}

    def _module(self, index: int) -> nn.Module:
        """Layer `index` on the meta device: copies of the meta model's modules."""
        meta = self.meta_model()
        parts = {k: copy.deepcopy(meta.get_submodule(path))
                 for k, path in self._parts(index).items()}
        if index == 0:
            return Embedding(parts["embed"], parts.get("positions"))
        if index == self._last:
            return precise_norms(Head(parts["norm"], parts["lm_head"]))
        return precise_norms(Block(parts["block"], parts.get("rotary")))

    def build_layer(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        module = self._module(index)
        if torch.device(device).type == "meta":
            return module
        if self.weights is not None:  # pretrained: the layer's tensors, read from the files
            module = self.empty_layer(index)
            self.weights.load_layer(self, index, module)
            return module.to(device)
        module = module.to_empty(device="cpu")
        self._init(module, index)
        for (i, name), (j, tied) in self.tied_parameters():
            if j == index:  # the second copy of a tied tensor starts as the first
                with torch.no_grad():
                    module.get_parameter(tied).copy_(self.build_layer(i).get_parameter(name))
        return module.to(device)

    def empty_layer(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Allocated for state loaded next, nothing read nor drawn for its parameters: only
        the buffers (the rotary tables, never part of the state) are computed."""
        module = self._module(index).to_empty(device="cpu")
        self._init(module, index, buffers_only=True)
        return module.to(device)

    @torch.no_grad()
    def _init(self, module: nn.Module, index: int, buffers_only: bool = False) -> None:
        """transformers' own initialisation (`_init_weights`, children before parents as
        `initialize_weights` does), drawn from the layer's own seed: the same values on every
        rank and device. The rotary buffers are recomputed by it too; `buffers_only`: only
        the modules owning buffers (their parameters, if any, are loaded next)."""
        init = self.meta_model()._init_weights
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(self.seed, index))
            for m in _post_order(module):
                if not buffers_only or m._buffers:
                    init(m)

    def layer_output_shape(self, index: int, batch_size: int, seq_len: int | None = None
                           ) -> tuple[tuple[int, ...], torch.dtype]:
        t = seq_len or self.seq_len
        if index == self._last:
            return (batch_size, t, self.arch.vocab_size), torch.float32
        return (batch_size, t, self.arch.d_model), torch.float32

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(logits, targets)

    def whole_model(self) -> nn.Module:
        """transformers' whole model (CPU, the default dtype, precise norms) holding the weights
        `build_layer` gives: the plain-Hugging-Face baseline the engine is timed against
        (bench/engine.py). Forward: `whole_model()(ids).logits`."""
        auto = _transformers(self.source).AutoModelForCausalLM
        net = auto.from_config(self.config, dtype=torch.get_default_dtype(),
                               attn_implementation=ATTENTION)
        state = {}
        for i in range(self.num_layers):
            names = self.hf_names(i)
            state.update({names[n]: p for n, p in self.build_layer(i).named_parameters()})
        net.load_state_dict(state, strict=True)
        return precise_norms(net)

    # ------------------------------------------------------------------ names and tying

    def hf_names(self, index: int) -> dict[str, str]:
        """Layer `index`'s parameters: our name -> the Hugging Face state-dict name."""
        names = {}
        for part, path in self._parts(index).items():
            for name, _ in self.meta_model().get_submodule(path).named_parameters():
                names[f"{part}.{name}"] = f"{path}.{name}"
        return names

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        if not self.arch.tied:
            return []
        return [((0, "embed.weight"), (self._last, "lm_head.weight"))]


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module
