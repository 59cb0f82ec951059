"""Hugging Face causal LMs as layer lists (models/hf.py), against transformers itself.

For every supported architecture a tiny random config.json is written (3 blocks, GQA where the
architecture has it, tied embeddings for llama and gpt2) and checked three ways:

- the layer list run layer by layer gives the logits of `AutoModelForCausalLM` built from the
  same file, with the same weights copied across by the name map (`hf_names`), fp64 <= 1e-9;
- the sizes read from config.json alone (models/hf_config.py, what the planner uses) count the
  parameters of transformers' model -- for the tiny configs and for config files that leave
  every size to transformers' defaults;
- N steps of our engine on local multi-node heterogeneous pipelines (a 2-GPU stage, the
  embedding and the head on different nodes, a rank holding both) equal N steps of the
  single-process Hugging Face model with the same AdamW, clipping and schedule (fp64 <= 1e-9),
  with activation recomputation too (train.recompute), and so does our single-process
  `Reference` (what `oobleck-hpc chaos` compares with), and a
  run whose layer states move to another plan mid-way (a reconfiguration, a restore);
- the README's example model (examples/models/tiny-llama) is what its script writes.

Skipped without transformers (`pip install 'oobleck_hpc[hf]'`; CI installs it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from oobleck_hpc.config import job_from_dict  # noqa: E402
from oobleck_hpc.engine.sampler import SyntheticTokens  # noqa: E402
from oobleck_hpc.models.hf_config import SUPPORTED, hf_arch  # noqa: E402
from oobleck_hpc.planning.plan import PipelineSpec, Plan, StageSpec, Template  # noqa: E402

VOCAB, SEQ, G = 96, 16, 2
_LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS = {
    "llama": {"model_type": "llama", **_LLAMA, "tie_word_embeddings": True,
              "attention_bias": True},
    "mistral": {"model_type": "mistral", **_LLAMA, "sliding_window": None, "head_dim": 16},
    "qwen2": {"model_type": "qwen2", **_LLAMA, "rope_theta": 1000.0},
    "gpt2": {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 3, "n_head": 4,
             "n_positions": 64, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "bos_token_id": 0, "eos_token_id": 0},
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": VOCAB, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "max_position_embeddings": 64, "rotary_pct": 0.5,
                 "use_parallel_residual": True},
}
assert set(CONFIGS) == set(SUPPORTED)


def write_config(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: write_config(root / arch, cfg) for arch, cfg in CONFIGS.items()}


def hf_model(directory):
    """transformers' own model of `directory`, fp64, the attention and norms the adapter uses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from oobleck_hpc.models.hf import precise_norms

    return precise_norms(AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(directory), attn_implementation="sdpa", dtype=torch.float64))


def load_ours(hf, model, layers: dict[int, torch.nn.Module]) -> None:
    """Copy our layers' parameters into the HF model by the name map: every HF tensor set."""
    state = {}
    for i, module in layers.items():
        names = model.hf_names(i)
        assert set(names) == {n for n, _ in module.named_parameters()}
        state.update({names[n]: p.detach() for n, p in module.named_parameters()})
    result = hf.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_layer_list_logits_equal_transformers(dirs, arch, float64):
    from oobleck_hpc.models.hf import HFModel

    model = HFModel(dirs[arch], seed=5)
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    hf = hf_model(dirs[arch])
    load_ours(hf, model, layers)
    x = torch.randint(VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    h = x
    for i in range(model.num_layers):
        h = layers[i](h)
    expected = hf(x).logits
    assert h.dtype == expected.dtype == torch.float64
    assert rel(h.detach(), expected.detach()) <= 1e-9
    # The tied pair is what transformers ties, and both copies start equal.
    tied = {model.hf_names(j)[b]: model.hf_names(i)[a]
            for (i, a), (j, b) in model.tied_parameters()}
    assert tied == dict(hf.all_tied_weights_keys)
    for (i, a), (j, b) in model.tied_parameters():
        assert torch.equal(layers[i].get_parameter(a), layers[j].get_parameter(b))


def test_dropout_is_off_so_a_step_is_a_pure_function(tmp_path, float64):
    """GPT-2's config.json asks for dropout 0.1 (its defaults): our layers, in training mode,
    give the same logits twice, equal to transformers' model in eval mode (no dropout)."""
    from oobleck_hpc.models.hf import HFModel

    config = {k: v for k, v in CONFIGS["gpt2"].items() if not k.endswith("pdrop")}
    directory = write_config(tmp_path / "gpt2", config)
    model = HFModel(directory, seed=1)
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    assert all(m.training for m in layers.values())
    hf = hf_model(directory)
    assert hf.config.attn_pdrop == 0.1
    load_ours(hf, model, layers)
    x = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))

    def ours():
        h = x
        for i in range(model.num_layers):
            h = layers[i](h)
        return h.detach()

    assert torch.equal(ours(), ours())
    assert rel(ours(), hf.eval()(x).logits.detach()) <= 1e-9


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_layers_build_alone_deterministically_and_on_meta(dirs, arch):
    from oobleck_hpc.models.hf import HFModel

    model = HFModel(dirs[arch], seed=5)
    for i in (0, 1, model.num_layers - 1):
        meta = model.build_layer(i, "meta")
        assert all(p.is_meta for p in meta.parameters())
        a, b = model.build_layer(i), model.build_layer(i)
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    def biggest(module):
        return max(module.parameters(), key=lambda p: p.numel())

    block = biggest(model.build_layer(1))
    assert not torch.equal(block, biggest(model.build_layer(2)))  # each layer its own stream
    assert not torch.equal(block, biggest(HFModel(dirs[arch], seed=6).build_layer(1)))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_sizes_from_config_json_count_the_parameters_of_transformers(dirs, tmp_path, arch):
    """What the planner reads without torch equals transformers' model, per layer (tiny
    config) and in total (a config.json that leaves every size to transformers' defaults,
    counted on the meta device)."""
    from oobleck_hpc.models.hf import HFModel
    from oobleck_hpc.profiling.analytic import analytic_profile

    model = HFModel(dirs[arch])
    profile = analytic_profile(model.arch, "A100-80G", 1, "float32", seq_len=SEQ)
    for i in range(model.num_layers):
        numel = sum(p.numel() for p in model.build_layer(i, "meta").parameters())
        assert profile.layers[i].param_bytes == 4 * numel
    defaults = {"model_type": arch, **({"sliding_window": None} if arch == "mistral" else {})}
    directory = write_config(tmp_path / "defaults", defaults)
    with torch.device("meta"):
        hf = hf_model(directory)
    assert hf_arch(directory, "<test>").total_params() == sum(p.numel() for p in hf.parameters())


def test_the_shipped_tiny_llama_is_what_its_script_writes(tmp_path):
    """examples/models/tiny-llama/config.json (the README's example model) is the output of
    examples/make_tiny_llama.py (whatever transformers version wrote it), and loads as ours."""
    import runpy
    from pathlib import Path

    from oobleck_hpc.models.hf import HFModel

    examples = Path(__file__).resolve().parents[1] / "examples"
    assert runpy.run_path(str(examples / "make_tiny_llama.py"))["main"]([str(tmp_path)]) == 0

    def config(directory):
        data = json.loads((directory / "config.json").read_text())
        data.pop("transformers_version")
        return data

    shipped = examples / "models" / "tiny-llama"
    assert config(tmp_path) == config(shipped)
    model = HFModel(shipped)
    assert (model.num_layers, model.arch.vocab_size, model.arch.tied) == (8, 256, True)


# ---------------------------------------------------------------- training, against transformers

def _job(directory, arch: str, recompute: bool = False):
    return job_from_dict({
        "name": f"hf-{arch}", "model": {"name": arch, "hf": str(directory), "seed": 3},
        "data": {"seq_len": SEQ},
        "train": {"steps": 10, "microbatch_size": 2, "global_microbatches": 8, "lr": 3e-3,
                  "warmup_steps": 1, "grad_clip": 0.5, "recompute": recompute},
        "cluster": {"nodes": 3, "gpus_per_node": G, "device": "cpu"},
        "fault_tolerance": {"collective_timeout_s": 60.0}})


def _template(n_nodes: int, stages) -> Template:
    specs = tuple(StageSpec(a, b, n, g) for a, b, n, g in stages)
    k = len(specs)
    return Template(n_nodes, G, specs, (1.0,) * k, (2.0,) * k, (0.1,) * (k - 1), (0,) * k)


def _plan(*pipes) -> Plan:
    return Plan(tuple(PipelineSpec(t, n, m) for t, n, m in pipes), sum(m for *_, m in pipes), 0.0)


# 5 layers: embedding, 3 blocks, head.
PLANS = {
    # the embedding on a 2-GPU stage of one node, the head on another node; a 1-node pipeline
    # beside it: the tied copies' holders are 5 of the 6 ranks
    "hetero": _plan((_template(2, [(0, 1, 0, (0, 1)), (1, 3, 1, (0,)), (3, 5, 1, (1,))]),
                     ("node0", "node1"), 5),
                    (_template(1, [(0, 2, 0, (0,)), (2, 5, 0, (1,))]), ("node2",), 3)),
    # one rank holds both copies (a data-parallel single-stage pipeline), beside a deep one
    "both_on_one_rank": _plan((_template(1, [(0, 5, 0, (0, 1))]), ("node2",), 3),
                              (_template(2, [(0, 2, 0, (0,)), (2, 3, 0, (1,)), (3, 4, 1, (0,)),
                                             (4, 5, 1, (1,))]), ("node1", "node0"), 5)),
}
STEPS = 3


def train_transformers(job, directory, model, data) -> tuple[list[float], dict, list[float]]:
    """The single-process Hugging Face model, from our initial weights: the same global
    batches, microbatch by microbatch, with engine/optim.py's AdamW, LR schedule and clipping."""
    from oobleck_hpc.engine.optim import lr_at, make_optimizer, set_lr
    from oobleck_hpc.engine.sampler import GlobalSampler
    from oobleck_hpc.models.interface import causal_lm_loss

    hf = hf_model(directory)
    load_ours(hf, model, {i: model.build_layer(i) for i in range(model.num_layers)})
    optimizer = make_optimizer([hf], job.train, torch.device("cpu"))
    sampler = GlobalSampler(data, job.train.microbatch_size, job.train.global_microbatches,
                            seed=job.model.seed)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for g in range(job.train.global_microbatches):
            x, y = sampler.microbatch(step * sampler.global_batch, g)
            loss = causal_lm_loss(hf(x).logits, y).sum()
            total += float(loss.detach())
            (loss / sampler.global_batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), job.train.grad_clip)))
        set_lr(optimizer, lr_at(step, job.train))
        optimizer.step()
        losses.append(total / sampler.global_batch)
    return losses, {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, norms


@pytest.fixture(scope="module")
def pool():
    from oobleck_hpc.testing.harness import WorkerPool

    p = WorkerPool(nodes=3, gpus_per_node=G)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_engine_on_pipelines_equals_the_transformers_model(pool, dirs, arch, float64):
    from oobleck_hpc.engine import Reference
    from oobleck_hpc.models.hf import HFModel

    job = _job(dirs[arch], arch)
    model = HFModel(dirs[arch], seed=job.model.seed)
    data = SyntheticTokens(VOCAB, SEQ, seed=1)
    losses, expected, norms = train_transformers(job, dirs[arch], model, data)
    assert max(norms) > job.train.grad_clip  # clipping acts
    assert abs(losses[0] - losses[-1]) > 1e-3  # the loss moves
    reference = Reference(job, model, data)
    assert np.allclose([reference.step() for _ in range(STEPS)], losses, rtol=1e-12, atol=0)
    worst = 0.0
    for i, layer in enumerate(reference.layers):
        for name, p in layer.named_parameters():
            worst = max(worst, rel(p.detach().numpy(), expected[model.hf_names(i)[name]]))
    assert worst <= 1e-9, f"Reference: max relative parameter difference {worst:.2e}"
    runs = [(name, plan, job) for name, plan in PLANS.items()]
    runs.append(("hetero, recompute", PLANS["hetero"], _job(dirs[arch], arch, recompute=True)))
    for name, plan, run_job in runs:
        results = [r for r in pool.run("engine", run_job, plan, STEPS, data, float64=True,
                                       timeout_s=300) if r is not None]
        assert sorted(r["rank"] for r in results) == list(range(plan.world_size))
        worst, seen = 0.0, set()
        for r in results:
            assert np.allclose(r["losses"], losses, rtol=1e-12, atol=0)
            assert np.allclose(r["norms"], norms, rtol=1e-9, atol=0)
            for (layer, our), value in r["params"].items():
                worst = max(worst, rel(value, expected[model.hf_names(layer)[our]]))
                seen.add(layer)
        assert seen == set(range(model.num_layers))
        assert worst <= 1e-9, f"{arch}, plan {name}: max relative parameter difference {worst:.2e}"
        print(f"{arch} {name}: max relative parameter difference {worst:.1e}")
    # bench/engine.py's baseline, the plain transformers model under torch DDP, does the same
    # math (HFModel.whole_model: the same weights, the tied tensor once)
    dp = _plan(*[(_template(1, [(0, 5, 0, (0, 1))]), (n,), m)
                 for n, m in (("node0", 3), ("node1", 3), ("node2", 2))])
    ranks = [r for r in pool.run("ddp", job, dp, STEPS, data, float64=True, timeout_s=300)
             if r is not None]
    assert len(ranks) == dp.world_size
    total = np.sum([r["losses"] for r in ranks], axis=0)  # each rank's rows' summed losses
    batch = job.train.global_microbatches * job.train.microbatch_size
    assert np.allclose(total / batch, losses, rtol=1e-12, atol=0)
    # Mid-run, every layer's state (weights, AdamW) handed from one plan's holders to another
    # plan, as a reconfiguration or a restore does: the two copies of a tied tensor come from
    # different ranks and must still be one tensor.
    first = [r for r in pool.run("engine", job, PLANS["hetero"], STEPS - 1, data, float64=True,
                                 timeout_s=300) if r is not None]
    states = {layer: s for r in first for layer, s in r["layer_states"].items()}
    (state,) = {r["state"] for r in first}
    second = [r for r in pool.run("engine", job, PLANS["both_on_one_rank"], 1, data, float64=True,
                                  timeout_s=300, resume=(states, state)) if r is not None]
    worst = max(rel(value, expected[model.hf_names(layer)[our]])
                for r in second for (layer, our), value in r["params"].items())
    assert worst <= 1e-9, f"{arch}, state moved between plans: {worst:.2e}"
