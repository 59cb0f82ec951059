"""Layer-list models: the GPT family, Hugging Face causal LMs, and the interface a user's own
model implements.

- `configs.py`    the GPT family's sizes and the job's model check: pure data, no torch (the
                  planner, analytic profiles and the simulator read it);
- `hf_config.py`  a Hugging Face config.json's sizes: pure data, no torch;
- `interface.py`  `LayerModel`, the interface every model implements, and `layer_generator`;
- `gpt.py`        the GPT as a layer list;
- `hf.py`         a Hugging Face causal LM as a layer list (the only module importing
                  transformers, an optional dependency: `pip install 'oobleck_hpc[hf]'`);
- `base.py`       `build_model(cfg)`: a built-in GPT by name, a Hugging Face config, or the
                  user's factory.

The torch-backed names (`LayerModel`, `build_model`, `layer_generator`) are imported on first use.
"""

from oobleck_hpc.models.configs import GPT_CONFIGS, GPTConfig, gpt_config

_LAZY = {"LayerModel", "build_model", "layer_generator"}


def __getattr__(name: str):
    if name in _LAZY:
        from oobleck_hpc.models import base

        return getattr(base, name)
    raise AttributeError(f"module 'oobleck_hpc.models' has no attribute {name!r}")


__all__ = ["GPT_CONFIGS", "GPTConfig", "LayerModel", "build_model", "gpt_config", "layer_generator"]
