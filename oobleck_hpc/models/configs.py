"""Architectures of the built-in GPT family, and the job's model check (`check_model`). Pure
data (no torch): the analytic profiler, the planner and the simulator read these without
importing torch.

A GPT is a layer list of `n_layer + 2` layers: layer 0 = token + position embedding,
layers 1..n_layer = transformer blocks, layer n_layer + 1 = final norm + LM head + loss.
Sizes follow the GPT-2 and GPT-3 papers (Brown et al. 2020, table 2.1); `gpt-tiny` and `gpt-mini`
are ours, small enough to train on a CPU in seconds. Where the paper's head count does not
divide d_model (1.3B: 24 heads of 128 for d_model 2048; 13B: d_model 5140) we keep d_model and
head size 128, which leaves the parameter count unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from oobleck_hpc.models.hf_config import hf_arch

if TYPE_CHECKING:
    from oobleck_hpc.config import ModelConfig


@dataclass(frozen=True)
class GPTConfig:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    mlp_ratio: int = 4

    @property
    def num_layers(self) -> int:
        """Layers the planner partitions: embedding + blocks + head."""
        return self.n_layer + 2

    def arch_hash(self) -> str:
        """Identifies the architecture (not the name) in profile fingerprints."""
        payload = {k: v for k, v in asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


GPT_CONFIGS: dict[str, GPTConfig] = {
    c.name: c
    for c in [
        GPTConfig("gpt-tiny", n_layer=4, d_model=64, n_head=4, seq_len=64, vocab_size=256),
        GPTConfig("gpt-mini", n_layer=8, d_model=256, n_head=8, seq_len=128, vocab_size=256),
        # Wide and shallow in time: weights dominate memory (50 MB of fp32 weights per block)
        # while a step stays cheap on a CPU (bench/recovery.py measures recovery's memory).
        GPTConfig("gpt-wide", n_layer=6, d_model=1024, n_head=16, seq_len=32, vocab_size=256),
        GPTConfig("gpt-wide-2x", n_layer=12, d_model=1024, n_head=16, seq_len=32, vocab_size=256),
        GPTConfig("gpt2-small", n_layer=12, d_model=768, n_head=12, seq_len=1024, vocab_size=50257),
        GPTConfig("gpt3-350m", n_layer=24, d_model=1024, n_head=16, seq_len=2048, vocab_size=50257),
        GPTConfig("gpt3-1.3b", n_layer=24, d_model=2048, n_head=16, seq_len=2048, vocab_size=50257),
        GPTConfig("gpt3-2.7b", n_layer=32, d_model=2560, n_head=32, seq_len=2048, vocab_size=50257),
        GPTConfig("gpt3-6.7b", n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=50257),
        GPTConfig("gpt3-13b", n_layer=40, d_model=5120, n_head=40, seq_len=2048, vocab_size=50257),
        GPTConfig("gpt3-175b", n_layer=96, d_model=12288, n_head=96, seq_len=2048, vocab_size=50257),
    ]
}


def gpt_config(name: str) -> GPTConfig:
    try:
        return GPT_CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; built-in models: {', '.join(GPT_CONFIGS)}") from None


def check_model(model: ModelConfig, where: Any) -> None:
    """`ModelConfig.check` (`where`: the config's key path, whose `fail` raises ConfigError):
    one source of layers -- a built-in GPT by name, the user's factory, or a Hugging Face
    config.json (read and checked here, without torch)."""
    if model.factory is not None and model.hf is not None:
        where.fail("hf", model.hf, "is given beside model.factory", "keep one of the two")
    if model.factory is not None and ":" not in model.factory:
        where.fail("factory", model.factory, "is not of the form package.module:function",
                   "write e.g. 'mypkg.models:build_layers'")
    if model.weights is not None and model.hf is None:
        where.fail("weights", model.weights, "is given without model.hf",
                   "set model.hf to the directory of the weights' config.json (pretrained "
                   "weights are read for Hugging Face models only)")
    if model.hf is not None:
        hf_arch(model.hf, where.source, where.key("hf"))
        if model.name in GPT_CONFIGS:  # the default name left as it was, most likely
            where.fail("name", model.name, "names a built-in GPT, but model.hf is set",
                       "name the Hugging Face model (e.g. after its directory): the name files "
                       "its profiles")
    elif model.factory is None and model.name not in GPT_CONFIGS:
        where.fail("name", model.name, "is not a built-in model",
                   f"use one of: {', '.join(GPT_CONFIGS)}, or set model.factory or model.hf")
