"""Layer-list models: the GPT family and the interface a user's own model implements."""

from oobleck_hpc.models.base import LayerModel, build_model, layer_generator
from oobleck_hpc.models.configs import GPT_CONFIGS, GPTConfig, gpt_config

__all__ = ["GPT_CONFIGS", "GPTConfig", "LayerModel", "build_model", "gpt_config", "layer_generator"]
