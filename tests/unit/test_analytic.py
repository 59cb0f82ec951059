"""Analytic profiles: parameter counts equal our models' own layers, FLOPs follow the documented
equations, the fingerprint says 'analytic', bad inputs are refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from oobleck_hpc.errors import ProfileError
from oobleck_hpc.models.configs import GPT_CONFIGS
from oobleck_hpc.profiling.analytic import DEVICES, OOBLECK_GPT3_6_7B_A40, analytic_profile

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-small", "gpt3-175b"])
def test_parameter_bytes_match_the_model(name):
    from oobleck_hpc.models.gpt import GPT

    model = GPT(GPT_CONFIGS[name])
    prof = analytic_profile(name, "A100-80G", 1, "float32", gpus_per_node=4)
    for i in (0, 1, model.num_layers - 1):  # embedding, a block, the head
        numel = sum(p.numel() for p in model.build_layer(i, "meta").parameters())
        layer = prof.layers[i]
        assert layer.param_bytes == 4 * numel
        assert layer.grad_bytes == 4 * numel and layer.optimizer_bytes == 8 * numel
    assert len(prof.layers) == model.num_layers


def test_gpt3_175b_totals_and_flops():
    prof = analytic_profile("gpt3-175b", "H100-80G", 2, "bfloat16")
    params = sum(x.param_bytes for x in prof.layers) / 4
    assert 174e9 < params < 176e9
    cfg = GPT_CONFIGS["gpt3-175b"]
    b, s, d = 2, cfg.seq_len, cfg.d_model
    flops = 2 * b * s * 12 * d * d + 4 * b * s * s * d
    block = prof.layers[1]
    h100 = DEVICES["H100-80G"]
    compute_ms = 1000 * flops / (h100.bf16_tflops * 1e12 * h100.matmul_efficiency)
    assert compute_ms < block.forward_ms < 1.2 * compute_ms  # plus activation traffic
    assert block.backward_ms == pytest.approx(2 * block.forward_ms, rel=0.05)
    assert block.activation_bytes == 34 * b * s * d  # bf16: 34 b s d bytes (no score storage)
    assert block.output_bytes == 2 * b * s * d
    fp = prof.fingerprint
    assert (fp.source, fp.device_name, fp.microbatch_size, fp.dtype, fp.gpus_per_node) == \
        ("analytic", "H100-80G", 2, "bfloat16", 8)
    assert fp.arch_hash == cfg.arch_hash()
    assert prof.machine.device_memory_bytes == 80 * 10**9


@pytest.mark.parametrize("name, params", [("llama2-70b", 68_976_648_192),
                                          ("llama3-8b", 8_030_261_248)])
def test_a_hugging_face_config_alone_gives_the_profile(name, params):
    """The shipped Llama configs (config.json only): the parameter count of transformers'
    LlamaForCausalLM built from the same file (counted on the meta device), GQA in the
    attention FLOPs, SwiGLU's three matrices, the fingerprint of the architecture."""
    from oobleck_hpc.models.hf_config import hf_arch

    arch = hf_arch(EXAMPLES / "models" / name, "<test>")
    assert arch.total_params() == params
    prof = analytic_profile(arch, "H100-80G", 1, "bfloat16", name=name, seq_len=4096)
    assert len(prof.layers) == arch.n_layer + 2
    assert sum(x.param_bytes for x in prof.layers) == 4 * params  # untied: every tensor once
    d, hd, s = arch.d_model, arch.head_dim, 4096
    matrices = d * d * 2 + 2 * d * arch.n_kv_head * hd + 3 * d * arch.intermediate
    h100 = DEVICES["H100-80G"]
    compute_ms = 1000 * (2 * s * matrices + 4 * s * s * d) / (h100.bf16_tflops * 1e12 * 0.5)
    assert compute_ms < prof.layers[1].forward_ms < 1.2 * compute_ms
    assert (prof.fingerprint.model_name, prof.fingerprint.arch_hash) == (name, arch.arch_hash())


def test_faster_device_is_faster_and_llama_like_exists():
    a40 = analytic_profile("gpt3-1.3b", "A40", 1)
    h100 = analytic_profile("gpt3-1.3b", "H100-80G", 1)
    assert h100.layers[1].forward_ms < a40.layers[1].forward_ms
    assert analytic_profile("llama-7b-like", "A100-80G", 1).num_layers == 34


@pytest.mark.parametrize("args, words", [
    (("gpt-huge", "A100-80G", 1), "no analytic model 'gpt-huge'"),
    (("gpt-tiny", "TPU", 1), "no analytic device 'TPU'. Fix: use one of A40, A100-80G, H100-80G"),
    (("gpt-tiny", "A40", 1, "float16"), "dtype 'float16' is not supported"),
])
def test_bad_inputs(args, words):
    with pytest.raises(ProfileError, match=words.replace("(", r"\(").replace(".", r"\.")):
        analytic_profile(*args)


def test_the_paper_example_predicts_the_cited_measurement_within_25_percent(capsys):
    """`oobleck-hpc plan examples/gpt3-6.7b-paper.yaml --nodes N`: the planner's samples/s,
    with the A40 efficiency calibrated on 30 nodes only, against Oobleck's measured throughput
    at every node count it published (16-30)."""
    import json
    from pathlib import Path

    from oobleck_hpc.cli import main
    from oobleck_hpc.config import load_job

    m = OOBLECK_GPT3_6_7B_A40
    example = Path(__file__).parents[2] / "examples" / "gpt3-6.7b-paper.yaml"
    job = load_job(str(example))
    assert (job.model.name, job.profile.device, job.cluster.gpus_per_node,
            job.train.microbatch_size, job.train.global_microbatches, job.cluster.nodes) == \
        (m.model, m.device, m.gpus_per_node, m.microbatch_size, m.global_microbatches,
         m.fit_nodes)
    errors = {}
    for nodes, measured in m.samples_per_s.items():
        assert main(["plan", str(example), "--nodes", str(nodes), "--json"]) == 0
        predicted = json.loads(capsys.readouterr().out)["plan"]["samples_per_s"]
        errors[nodes] = predicted / measured - 1
    assert all(abs(e) <= 0.25 for e in errors.values()), errors


def test_efficiency_is_the_device_s_unless_given():
    a40 = analytic_profile("gpt3-1.3b", "A40", 1)
    faster = analytic_profile("gpt3-1.3b", "A40", 1,
                              matmul_efficiency=2 * DEVICES["A40"].matmul_efficiency)
    assert faster.layers[1].forward_ms < a40.layers[1].forward_ms
    assert faster.layers[0].forward_ms == a40.layers[0].forward_ms  # the embedding: memory traffic
    with pytest.raises(ProfileError, match="matmul_efficiency 0 must be in"):
        analytic_profile("gpt3-1.3b", "A40", 1, matmul_efficiency=0)
