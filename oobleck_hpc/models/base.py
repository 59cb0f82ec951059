"""The job's model: `build_model(cfg)` builds a built-in GPT by name, a Hugging Face model from
its config.json (`model.hf`, models/hf.py: imported only then), or calls the user's factory.

The interface every model implements (`LayerModel`, `layer_generator`) is in interface.py and is
importable from here too: a user's factory subclasses `oobleck_hpc.models.base.LayerModel` (or
`oobleck_hpc.models.interface.LayerModel`, the same class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oobleck_hpc.errors import ConfigError
from oobleck_hpc.models.configs import GPT_CONFIGS
from oobleck_hpc.models.factory import load_factory
from oobleck_hpc.models.gpt import GPT
from oobleck_hpc.models.interface import LayerModel, layer_generator

if TYPE_CHECKING:
    from oobleck_hpc.config import ModelConfig

__all__ = ["LayerModel", "build_model", "layer_generator"]


def build_model(cfg: ModelConfig, source: str = "<job>") -> LayerModel:
    """The job's model: a built-in GPT by name, a Hugging Face config, or the user's factory."""
    if cfg.hf is not None:
        from oobleck_hpc.models.hf import HFModel

        return HFModel(cfg.hf, name=cfg.name, seed=cfg.seed, source=source,
                       weights=cfg.weights)
    if cfg.factory is None:
        if cfg.name not in GPT_CONFIGS:
            raise ConfigError(source, "model.name", f"value {cfg.name!r} is not a built-in model",
                              f"use one of: {', '.join(GPT_CONFIGS)}, or set model.factory or "
                              f"model.hf")
        return GPT(GPT_CONFIGS[cfg.name], seed=cfg.seed)

    factory = load_factory(cfg.factory, source)
    model = factory(cfg)
    if not isinstance(model, LayerModel):
        raise ConfigError(source, "model.factory",
                          f"value {cfg.factory!r} returned {type(model).__name__}, not a LayerModel",
                          "return an instance of a subclass of oobleck_hpc.models.base.LayerModel")
    if model.num_layers < 2:
        raise ConfigError(source, "model.factory",
                          f"value {cfg.factory!r} returned a model with {model.num_layers} layers",
                          "return at least two layers (input layer and output layer)")
    return model
