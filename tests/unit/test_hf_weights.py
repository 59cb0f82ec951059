"""Pretrained weights in (`model.weights`, models/hf_weights.py) and standard weights out
(`oobleck-hpc export`, oobleck_hpc/checkpoint/export.py), against transformers itself, in fp64:

- weights saved by `save_pretrained` (one file, and sharded), tied and untied, loaded into our
  layers equal the transformers model's parameters and logits before any step;
- a rank building some layers reads only their tensors; a layer allocated for a restore or a
  transfer (`empty_layer`) reads nothing;
- a missing tensor or a wrong shape is a ConfigError naming the tensor and the file, before
  any node starts (the launcher's pre-flight) and when loading;
- pretrained in -> train -> checkpoint -> export -> from_pretrained: the exported model's
  logits equal the run's final state.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from oobleck_hpc.config import job_from_dict  # noqa: E402
from oobleck_hpc.engine.sampler import SyntheticTokens  # noqa: E402
from oobleck_hpc.errors import ConfigError  # noqa: E402
from oobleck_hpc.models.hf import precise_norms  # noqa: E402

VOCAB, SEQ = 96, 16
CONFIGS = {  # tied (with GPT-2's bare-prefix variant below) and untied
    "llama": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 3, "n_head": 4,
             "n_positions": 64, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
}


def pretrained(directory, arch: str, sharded: bool = False):
    """A random transformers model of `arch` (fp64), saved as save_pretrained writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS[arch]))
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory),
                                          attn_implementation="sdpa", dtype=torch.float64)
    hf.save_pretrained(directory, max_shard_size="20KB" if sharded else "5GB")
    return precise_norms(hf.eval())


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def logits(layers, x):
    h = x
    for m in layers:
        h = m(h)
    return h


@pytest.mark.parametrize("arch,sharded", [("llama", False), ("llama", True), ("qwen2", True),
                                          ("gpt2", False)])
def test_weights_in_equal_the_model_transformers_loads(tmp_path, float64, arch, sharded):
    from oobleck_hpc.models.hf import HFModel

    hf = pretrained(tmp_path / arch, arch, sharded)
    assert (tmp_path / arch / "model.safetensors.index.json").exists() == sharded
    model = HFModel(tmp_path / arch, weights=tmp_path / arch, seed=1)
    layers = [model.build_layer(i) for i in range(model.num_layers)]
    expected = hf.state_dict()
    for i, layer in enumerate(layers):
        for ours, p in layer.named_parameters():
            assert torch.equal(p, expected[model.hf_names(i)[ours]]), (i, ours)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(logits(layers, x), hf(x).logits) <= 1e-12
    assert model.arch.tied == (arch != "qwen2")


def test_a_bare_base_model_checkpoint_is_read_too(tmp_path, float64):
    """GPT-2's original files name tensors without the `transformer.` prefix."""
    from safetensors.torch import load_file, save_file

    from oobleck_hpc.models.hf import HFModel

    hf = pretrained(tmp_path, "gpt2")
    state = load_file(tmp_path / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in state.items()},
              tmp_path / "model.safetensors")
    model = HFModel(tmp_path, weights=tmp_path)
    head = model.build_layer(model.num_layers - 1)
    assert torch.equal(head.lm_head.weight, hf.lm_head.weight)


def test_a_rank_reads_only_the_tensors_of_its_layers(tmp_path, float64):
    from oobleck_hpc.models.hf import HFModel

    pretrained(tmp_path, "llama", sharded=True)
    model = HFModel(tmp_path, weights=tmp_path)
    for i in (1, 2):
        model.build_layer(i)
    assert sorted(model.weights.read) == sorted(n for i in (1, 2)
                                                for n in model.hf_names(i).values())
    model.weights.read.clear()
    for i in range(model.num_layers):  # allocated for a checkpoint's or a replica's state
        empty = dict(model.empty_layer(i).named_buffers())  # the rotary tables computed
        built = dict(model.build_layer(i).named_buffers())
        assert empty.keys() == built.keys()
        assert all(torch.equal(empty[k], b) for k, b in built.items())
        model.weights.read.clear()
    assert model.weights.read == []
    model.empty_layer(1)
    assert model.weights.read == []
    # the tied head reads the embedding's tensor (save_pretrained wrote it once)
    model.build_layer(model.num_layers - 1)
    assert "model.embed_tokens.weight" in model.weights.read


def _job(directory, weights, **extra):
    return job_from_dict({
        "name": "pre", "model": {"name": "pre", "hf": str(directory), "weights": str(weights),
                                 "seed": 3, "dtype": "float64"},
        "data": {"seq_len": SEQ},
        "train": {"steps": 3, "microbatch_size": 2, "global_microbatches": 4, "lr": 3e-3,
                  "warmup_steps": 1, "grad_clip": 0.5},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"}, **extra})


def test_a_name_or_shape_mismatch_names_the_tensor_and_file(tmp_path, float64):
    from safetensors.torch import load_file, save_file

    from oobleck_hpc.launch.cli import check_local_inputs
    from oobleck_hpc.models.hf import HFModel

    pretrained(tmp_path / "w", "qwen2")
    file = tmp_path / "w" / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, file)
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*"
                                          r"model\.safetensors") as e:
        check_local_inputs(_job(tmp_path / "w", tmp_path / "w"))
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="up_proj"):  # and when a rank loads the layer
        HFModel(tmp_path / "w", weights=tmp_path / "w").build_layer(2)

    other = dict(CONFIGS["qwen2"], intermediate_size=40)  # same names, other shapes
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                          r"of .*model\.safetensors has shape \[48, 32\]"):
        check_local_inputs(_job(tmp_path / "o", tmp_path / "w"))
    with pytest.raises(ConfigError, match="without model.hf"):
        job_from_dict({"model": {"weights": str(tmp_path / "w")}})
    with pytest.raises(ConfigError, match="neither model.safetensors"):
        HFModel(tmp_path / "o", weights=tmp_path / "o")


def test_pretrained_in_train_export_from_pretrained(tmp_path, float64, capsys):
    """The round trip: weights in, three steps of the reference, a checkpoint, export, and
    transformers' from_pretrained: its logits are the run's final state's."""
    from transformers import AutoModelForCausalLM

    from oobleck_hpc.checkpoint import Checkpointer, layer_state
    from oobleck_hpc.cli import main
    from oobleck_hpc.engine import Reference
    from oobleck_hpc.models.base import build_model

    pretrained(tmp_path / "w", "llama")
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    (tmp_path / "w" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    job = _job(tmp_path / "w", tmp_path / "w",
               checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 1})
    job.data.tokenizer = str(tmp_path / "tok")
    model = build_model(job.model)
    ref = Reference(job, model, SyntheticTokens(VOCAB, SEQ, seed=1))
    for _ in range(job.train.steps):
        ref.step()
    writer = Checkpointer(job.checkpoint, rank=0, num_layers=model.num_layers)
    writer.save_sync(ref.state.step, {i: layer_state(m, ref.optimizer)
                                      for i, m in enumerate(ref.layers)}, ref.state)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    import yaml

    (run_dir / "job.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(job.to_dict()))))
    out = tmp_path / "out"
    assert main(["export", str(run_dir), "--hf", str(out), "--max-shard-gb", "0.00002"]) == 0
    assert "exported step 3" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "tokenizer.json" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # the tied tensor once
    # the config names the tensors' dtype (the run's), not the one of the job's (bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
    hf = precise_norms(AutoModelForCausalLM.from_pretrained(
        out, dtype="auto", attn_implementation="sdpa").eval())
    assert hf.dtype == torch.float64
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(hf(x).logits, logits(ref.layers, x)) <= 1e-9
    # never half-written, never over a non-empty directory unless --force
    assert main(["export", str(run_dir), "--hf", str(out)]) == 2
    assert main(["export", str(run_dir), "--hf", str(out), "--step", "3", "--force"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
