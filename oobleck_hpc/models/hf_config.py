"""A Hugging Face causal LM's architecture read from its config.json alone: pure data, no torch,
no transformers. The planner, the analytic profile and the job's validation read it; the layer
list itself (`models/hf.py`, the only module importing transformers) is built from the same
file.

`model: {hf: DIR}` names a directory holding a `config.json` as `save_pretrained` writes it.
Supported `model_type`s (SUPPORTED): llama (Llama 2 and 3), mistral, qwen2, gpt2, gpt_neox.
A key missing from config.json takes the default of transformers' own config class (the
`_DEFAULTS` table, checked against transformers by tests/test_hf_models.py).

The layer list (`HFArch.num_layers = n_layer + 2`): layer 0 = input embeddings (+ learned
positions for gpt2), layers 1..n_layer = the decoder blocks, the last = final norm + LM head.
Each layer's tensors keep their Hugging Face state-dict names (`HFArch.parts`): a layer's
module is a plain name mapping away from a `save_pretrained` checkpoint.

Parameters per layer (d hidden, I intermediate, H heads, K key/value heads, h head size, V
vocabulary, P learned positions)::

    embedding   V d  (+ P d for gpt2)
    block       attention  d H h + 2 d K h + H h d       (+ biases: q, k, v, o as the arch has)
                MLP        3 d I (gated: SwiGLU) or 2 d I    (+ biases)
                norms      2 d (RMSNorm) or 4 d (LayerNorm)
    head        final norm d or 2 d, plus LM head V d (a copy of the embedding when tied)

Not supported (refused with the reason): sliding-window attention narrower than the context
(Mistral v0.1's 4096, Qwen2 with use_sliding_window): each block's layer attends with the plain
causal mask it rebuilds itself.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oobleck_hpc.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")

# transformers 5's config defaults for the keys read here (configuration_<arch>.py).
_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
          "head_dim": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
          "attention_bias": False, "mlp_bias": False}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {**_LLAMA, "vocab_size": 151936, "intermediate_size": 22016,
              "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096},
    "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_inner": None, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "tie_word_embeddings": True},
    "gpt_neox": {"vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576,
                 "num_hidden_layers": 44, "num_attention_heads": 64,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False,
                 "attention_bias": True},
}


@dataclass(frozen=True)
class Parts:
    """Where a layer's tensors live in the Hugging Face model (state-dict prefixes)."""

    embed: str
    blocks: str
    """The decoder blocks' list: block i is `{blocks}.{i}`."""
    norm: str
    head: str = "lm_head"
    positions: str | None = None
    """Learned position embeddings (gpt2)."""
    rotary: str | None = None
    """The rotary embedding module (buffers only; rebuilt inside every block's layer)."""


_LLAMA_PARTS = Parts("model.embed_tokens", "model.layers", "model.norm",
                     rotary="model.rotary_emb")
PARTS: dict[str, Parts] = {
    "llama": _LLAMA_PARTS, "mistral": _LLAMA_PARTS, "qwen2": _LLAMA_PARTS,
    "gpt2": Parts("transformer.wte", "transformer.h", "transformer.ln_f",
                  positions="transformer.wpe"),
    "gpt_neox": Parts("gpt_neox.embed_in", "gpt_neox.layers", "gpt_neox.final_layer_norm",
                      rotary="gpt_neox.rotary_emb"),
}


@dataclass(frozen=True)
class HFArch:
    """The sizes of a supported Hugging Face causal LM (module docstring)."""

    model_type: str
    n_layer: int
    d_model: int
    intermediate: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int
    max_positions: int
    tied: bool
    """Input and output embeddings share one tensor (tie_word_embeddings)."""
    gated_mlp: bool
    """SwiGLU (gate, up, down: three matrices) rather than fc + activation + proj."""
    layer_norm: bool
    """LayerNorm (weight and bias) rather than RMSNorm (weight only)."""
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    learned_positions: int
    """Rows of the learned position embedding (gpt2), else 0 (rotary)."""

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    @property
    def parts(self) -> Parts:
        return PARTS[self.model_type]

    def embedding_params(self) -> int:
        return (self.vocab_size + self.learned_positions) * self.d_model

    def block_matrix_params(self) -> int:
        """Entries of the block's weight matrices (what its matmuls multiply by)."""
        d, h = self.d_model, self.head_dim
        attention = d * self.n_head * h + 2 * d * self.n_kv_head * h + self.n_head * h * d
        return attention + (3 if self.gated_mlp else 2) * d * self.intermediate

    def block_params(self) -> int:
        d, h, inter = self.d_model, self.head_dim, self.intermediate
        biases = ((self.n_head + 2 * self.n_kv_head) * h if self.qkv_bias else 0) \
            + (d if self.o_bias else 0) \
            + (((2 if self.gated_mlp else 1) * inter + d) if self.mlp_bias else 0)
        norms = (4 if self.layer_norm else 2) * d
        return self.block_matrix_params() + biases + norms

    def head_params(self) -> int:
        return (2 if self.layer_norm else 1) * self.d_model + self.vocab_size * self.d_model

    def total_params(self) -> int:
        """Parameters of the Hugging Face model: the tied embedding counted once."""
        total = self.embedding_params() + self.n_layer * self.block_params() + self.head_params()
        return total - (self.vocab_size * self.d_model if self.tied else 0)

    def arch_hash(self) -> str:
        """Identifies the architecture in profile fingerprints."""
        payload = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]


def config_path(directory: str | Path) -> Path:
    return Path(directory) / "config.json"


def read_hf_config(directory: str | Path, source: str, key: str = "model.hf") -> dict[str, Any]:
    """config.json of `directory` as a dict; ConfigError (file `source`, `key`) naming the file
    when it is missing, unreadable or not a JSON object."""
    path = config_path(directory)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(source, key, f"value {str(directory)!r}: {path} cannot be read "
                          f"({e.strerror})", "name a directory holding a Hugging Face "
                          "config.json (as save_pretrained writes it)") from e
    except ValueError as e:
        raise ConfigError(source, key, f"value {str(directory)!r}: {path} is not JSON ({e})",
                          "give the config.json that save_pretrained wrote") from e
    if not isinstance(data, dict):
        raise ConfigError(source, key, f"value {str(directory)!r}: {path} is not a JSON object",
                          "give the config.json that save_pretrained wrote")
    return data


def hf_arch(directory: str | Path, source: str, key: str = "model.hf") -> HFArch:
    """The architecture described by `directory`/config.json (module docstring); ConfigError
    for an unsupported model_type (naming the supported ones), a size that is not a positive
    integer, or sliding-window attention."""
    raw = read_hf_config(directory, source, key)
    path = config_path(directory)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(source, key, f"value {str(directory)!r}: {path} has model_type "
                          f"{model_type!r}, which is not supported",
                          f"use a model of one of the supported types: {', '.join(SUPPORTED)}")
    cfg = {**_DEFAULTS[model_type], **raw}  # an explicit null stays null (e.g. sliding_window)

    def size(name: str) -> int:
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(source, key, f"value {str(directory)!r}: {path} has {name} = "
                              f"{value!r}, not a positive integer",
                              f"set {name} in {path} to the model's size")
        return value

    def flag(name: str) -> bool:
        value = cfg.get(name, False)
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"value {str(directory)!r}: {path} has {name} = "
                              f"{value!r}, not true/false", f"write {name}: true or false")
        return value

    def head_size(d: int, heads: int, explicit: str | None = None) -> int:
        if explicit is not None and cfg.get(explicit) is not None:
            return size(explicit)
        if d % heads:
            raise ConfigError(source, key, f"value {str(directory)!r}: {path} has a hidden size "
                              f"of {d}, not divisible by its {heads} attention heads",
                              "give a config.json of a model transformers can build")
        return d // heads

    if model_type == "gpt2":
        d, heads = size("n_embd"), size("n_head")
        head_dim = head_size(d, heads)
        inter = size("n_inner") if cfg.get("n_inner") is not None else 4 * d
        return HFArch("gpt2", size("n_layer"), d, inter, heads, heads, head_dim,
                      size("vocab_size"), size("n_positions"), flag("tie_word_embeddings"),
                      gated_mlp=False, layer_norm=True, qkv_bias=True, o_bias=True,
                      mlp_bias=True, learned_positions=size("n_positions"))
    d, heads = size("hidden_size"), size("num_attention_heads")
    kv = size("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    head_dim = head_size(d, heads, None if model_type == "gpt_neox" else "head_dim")
    _refuse_sliding_window(model_type, cfg, size("max_position_embeddings"), source, key, path)
    common = dict(model_type=model_type, n_layer=size("num_hidden_layers"), d_model=d,
                  intermediate=size("intermediate_size"), n_head=heads,
                  vocab_size=size("vocab_size"),
                  max_positions=size("max_position_embeddings"), tied=flag("tie_word_embeddings"),
                  learned_positions=0)
    if model_type == "gpt_neox":
        bias = flag("attention_bias")
        return HFArch(**common, n_kv_head=heads, head_dim=head_dim, gated_mlp=False,
                      layer_norm=True, qkv_bias=bias, o_bias=bias, mlp_bias=True)
    if model_type == "qwen2":
        return HFArch(**common, n_kv_head=kv, head_dim=head_dim, gated_mlp=True,
                      layer_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False)
    bias = model_type == "llama" and flag("attention_bias")
    return HFArch(**common, n_kv_head=kv, head_dim=head_dim, gated_mlp=True, layer_norm=False,
                  qkv_bias=bias, o_bias=bias, mlp_bias=model_type == "llama" and flag("mlp_bias"))


def require_transformers(source: str) -> None:
    """ConfigError (exit 2) unless transformers >= 5, safetensors and tokenizers are installed:
    said once before a model.hf job starts, instead of by every worker (looked up, not
    imported)."""
    missing = [m for m in ("transformers", "safetensors", "tokenizers")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(source, "model.hf", f"needs {', '.join(missing)}, not installed here",
                          "install the extra: pip install 'oobleck_hpc[hf]'")
    check_transformers_version(importlib.metadata.version("transformers"), source)


def check_transformers_version(version: str, source: str) -> None:
    """models/hf.py uses transformers 5's module API (decoder layers that return a tensor)."""
    if int(version.split(".")[0]) < 5:
        raise ConfigError(source, "model.hf", f"needs transformers 5 or later, not {version}",
                          "upgrade: pip install 'oobleck_hpc[hf]' (transformers>=5.0)")


def _refuse_sliding_window(model_type: str, cfg: dict, context: int, source: str, key: str,
                           path: Path) -> None:
    window = cfg.get("sliding_window")
    active = (model_type == "mistral" or (model_type == "qwen2" and cfg.get("use_sliding_window")))
    if active and isinstance(window, int) and window < context:
        raise ConfigError(source, key, f"{path} uses sliding-window attention (sliding_window = "
                          f"{window} < max_position_embeddings = {context}), which is not "
                          "supported", "set sliding_window to null in config.json (full causal "
                          "attention: the same model for sequences up to the window)")
