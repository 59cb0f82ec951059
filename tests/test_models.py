"""Models: deterministic layer-by-layer construction, meta-device description, user factories."""

import subprocess
import sys

import pytest
import torch

from oobleck_hpc.config import ModelConfig
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.models import GPT_CONFIGS, LayerModel, build_model

DIGEST_SNIPPET = """
import hashlib, torch
from oobleck_hpc.config import ModelConfig
from oobleck_hpc.models import build_model
m = build_model(ModelConfig(name="gpt-tiny", seed=7))
h = hashlib.sha256()
for i in range(m.num_layers):
    for name, p in sorted(m.build_layer(i).state_dict().items()):
        h.update(name.encode()); h.update(p.numpy().tobytes())
print(h.hexdigest())
"""


def _digest_here(seed: int) -> str:
    import hashlib

    m = build_model(ModelConfig(name="gpt-tiny", seed=seed))
    h = hashlib.sha256()
    for i in range(m.num_layers):
        for name, p in sorted(m.build_layer(i).state_dict().items()):
            h.update(name.encode())
            h.update(p.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.timeout(60)
def test_same_seed_same_weights_in_another_process():
    out = subprocess.run([sys.executable, "-c", DIGEST_SNIPPET], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == _digest_here(7)
    assert _digest_here(8) != _digest_here(7)


def test_layer_does_not_depend_on_which_other_layers_were_built():
    m = build_model(ModelConfig(name="gpt-tiny", seed=3))
    alone = m.build_layer(2).state_dict()
    for i in (0, 1, 3):
        m.build_layer(i)
    again = m.build_layer(2).state_dict()
    assert all(torch.equal(alone[k], again[k]) for k in alone)
    # Blocks are independent streams, not copies of each other.
    assert not torch.equal(m.build_layer(1).state_dict()["qkv.weight"], alone["qkv.weight"])


def test_meta_device_describes_175b_without_memory():
    m = build_model(ModelConfig(name="gpt3-175b"))
    block = m.build_layer(1, device="meta")
    params = sum(p.numel() for p in block.parameters())
    d = GPT_CONFIGS["gpt3-175b"].d_model
    assert params == 12 * d * d + 13 * d  # qkv + proj + 2 MLP matrices, their biases, 2 LayerNorms
    assert all(p.is_meta for p in block.parameters())


def test_layers_compose_to_a_language_model():
    m = build_model(ModelConfig(name="gpt-tiny"))
    x = torch.randint(0, 256, (3, m.seq_len))
    h = x
    for i in range(m.num_layers):
        h = m.build_layer(i)(h)
        assert h.shape == m.layer_output_shape(i, 3)[0]
    loss = m.loss(h, x)
    assert loss.shape == (3,)
    assert abs(loss.mean().item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near uniform at init


class _NotAModel:
    pass


def bad_factory(cfg):
    return _NotAModel()


def test_user_factory_errors_name_the_key_and_fix():
    with pytest.raises(ConfigError, match=r"model.factory.*returned _NotAModel.*LayerModel"):
        build_model(ModelConfig(name="mine", factory=f"{__name__}:bad_factory"))
    with pytest.raises(ConfigError, match=r"model.factory.*cannot be imported"):
        build_model(ModelConfig(name="mine", factory="no_such_module_xyz:f"))
    with pytest.raises(ConfigError, match=r"model.name.*not a built-in model"):
        build_model(ModelConfig(name="gpt-huge"))


def good_factory(cfg):
    from oobleck_hpc.models.configs import GPTConfig
    from oobleck_hpc.models.gpt import GPT

    return GPT(GPTConfig("mine", n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=256), seed=cfg.seed)


def test_user_factory_returning_a_layer_model_is_used():
    m = build_model(ModelConfig(name="mine", factory=f"{__name__}:good_factory"))
    assert isinstance(m, LayerModel) and m.num_layers == 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_loss_is_computed_in_fp32_at_least_and_never_below_the_model_dtype(dtype):
    """fp64 runs are compared with references at 1e-6: a loss cast down to fp32 gave the GPU run
    1.3e-6 on one GPU (its fp32 reductions sum in another order than the CPU's)."""
    m = build_model(ModelConfig(name="gpt-tiny"))
    logits = torch.randn(2, 4, m.cfg.vocab_size, dtype=dtype)
    loss = m.loss(logits, torch.randint(0, m.cfg.vocab_size, (2, 4)))
    assert loss.dtype == torch.promote_types(dtype, torch.float32)


def test_without_transformers_gpt_runs_and_a_hugging_face_job_says_what_to_install(tmp_path):
    """transformers is optional: with it missing, the GPT family builds as before, and a
    model.hf job fails with the extra to install (exit 2, ConfigError)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 16, '
                                          '"num_attention_heads": 2, "num_hidden_layers": 1, '
                                          '"intermediate_size": 32, "vocab_size": 64}')
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from oobleck_hpc.config import ModelConfig\n"
        "from oobleck_hpc.errors import ConfigError\n"
        "from oobleck_hpc.models import build_model\n"
        "gpt = build_model(ModelConfig(name='gpt-tiny'))\n"
        "assert gpt.build_layer(1) is not None and gpt.tied_parameters() == []\n"
        "try:\n"
        f"    build_model(ModelConfig(name='tiny-llama', hf={str(tmp_path)!r}), 'job.yaml')\n"
        "except ConfigError as e:\n"
        "    print(e.exit_code, e)\n"
        "from oobleck_hpc.models.hf_config import require_transformers\n"
        "try:\n"
        "    require_transformers('job.yaml')\n"
        "except ConfigError as e:\n"
        "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert out.startswith("2 job.yaml: key 'model.hf': needs the transformers package"), out
    assert "pip install 'oobleck_hpc[hf]'" in out
    # what `oobleck-hpc run` checks before it starts any process (launch.cli.check_local_inputs)
    assert "job.yaml: key 'model.hf': needs transformers, not installed here" in out
