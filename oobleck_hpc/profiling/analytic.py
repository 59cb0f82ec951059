"""Analytic profiles: per-layer times and bytes from FLOP and byte counts plus a device sheet.

For machines we do not have (the planner and the simulator at 1,024 GPUs). Labelled
`source="analytic"` in the fingerprint. Pure arithmetic: no torch.

Not modelled here (schema 2 fields left empty): `optimizer_ms` is 0 and there are no per-row
times (`forward_rows_ms`), so the cost model charges a k-GPU stage the ideal split f / k.

Model (a GPT of oobleck_hpc/models/configs.py, microbatch b samples of s tokens, width d,
vocabulary V, MLP ratio r = 4). Layers: embedding, n_layer blocks, head (untied, as our models).

Parameters::

    embedding   V d + s d
    block       (4 + 2 r) d^2 + (9 + r) d        qkv 3d^2+3d, proj d^2+d, fc r d^2 + r d,
                                                out r d^2 + d, two LayerNorms 4d
    head        2 d + d V                        final LayerNorm, LM head without bias

Forward FLOPs per microbatch (2 per multiply-add; backward = 2 x forward)::

    embedding   0 (a gather; charged as memory traffic, see below)
    block       2 b s ((4 + 2 r) d^2)  +  4 b s^2 d       dense matmuls + attention (QK^T, AV)
    head        2 b s d V

time = FLOPs / (peak_flops(dtype) * efficiency), plus for every layer the activation traffic
bytes_moved / (memory_bandwidth * 0.7); the embedding costs only that. `efficiency` is the
fraction of the dense peak a training run reaches, per device (DeviceSpec.matmul_efficiency),
each from a published measurement:

    A100-80G   0.50    Megatron-LM (Narayanan et al., SC'21, arXiv 2104.04473): a 1-trillion-
                       parameter GPT on 3,072 A100s at 52 % of peak per GPU.
    H100-80G   0.50    no measurement cited here: the A100 figure, carried over.
    A40        0.115   calibrated on the Oobleck artifact's measured GPT-3 6.7B throughput
                       (SymbioticLab/Oobleck, tools/simulator/oobleck_simulator.py at commit
                       e079df1, gpt_3_6_7b_simulate_step_delta): 30 nodes of one A40, global
                       batch 1024 sequences of 2048 tokens, 5.51 samples/s. 0.115 is the
                       efficiency at which our planner predicts that job at 5.51 samples/s
                       (`python bench/calibrate.py` bisects it; its 3 significant digits are
                       kept). The same table's 15 other node counts (16-29 nodes), not used in
                       the fit, are predicted within 16 % (tests/unit/test_analytic.py checks 25 %).
                       It means ~17 TFLOP/s per A40 (6 x 6.7e9 x 2048 FLOPs per sample): what
                       the authors' run reached; the artifact does not say why so little of the
                       peak (precision, recomputation, network, framework are not given).

Bytes (per microbatch unless said otherwise). Training keeps fp32 master parameters (our models'
parameters are float32; `bfloat16` turns on autocast for the compute), so per parameter:
param 4, grad 4, AdamW exp_avg + exp_avg_sq 8. Activation element size e = 2 for bfloat16, 4 for
float32. Activations kept for backward (Korthikanti et al. 2022, "Reducing Activation
Recomputation", without the 5 a s / d attention-score term because our blocks use fused
scaled-dot-product attention that does not store the scores)::

    block       34 b s d * e / 2
    embedding   b s d e
    head        b s d e  +  4 b s V          (input, and fp32 logits for the loss)

Output sent to the next layer: b s d e (the head sends nothing onwards: its loss, 4 bytes).

Devices (dense tensor-core peak; links per GPU, with an achievable fraction of 0.8 applied)::

    A40        bf16 149.7 TFLOP/s, fp32 37.4, 48 GB,  HBM 696 GB/s,  NVLink bridge 112.5 GB/s,
               HDR InfiniBand 25 GB/s
    A100-80G   bf16 312,   fp32 19.5 (TF32 156 used for matmuls), 80 GB, 2039 GB/s,
               NVLink 600 GB/s, HDR 25 GB/s per GPU
    H100-80G   bf16 989,   fp32 67 (TF32 494.7 used for matmuls),  80 GB, 3350 GB/s,
               NVLink 900 GB/s, NDR 50 GB/s per GPU

Latencies: 0.01 ms inside a node, 0.02 ms across nodes.

Hugging Face models (models/hf_config.py: d hidden, I intermediate, H heads of size h, K
key/value heads, V vocabulary; parameters as `HFArch` counts them, the tied embedding once per
layer that holds a copy). Forward FLOPs: 2 b s x (the block's matrix entries) + 4 b s^2 H h
(attention), the head 2 b s d V. Activations kept per token, in elements of e bytes: the two
norms' inputs, the attention and MLP inputs and the residual 5 d, q, k, v (H + 2K) h, the
attention output H h, the MLP's hidden 2 I (fc, activation) or 4 I (SwiGLU: gate, up,
activation, product) -- for a GPT block (K = H, H h = d, I = 4 d) the same 17 d as above.
Embedding and head as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from oobleck_hpc.errors import ProfileError
from oobleck_hpc.models.configs import GPT_CONFIGS, GPTConfig
from oobleck_hpc.models.hf_config import HFArch
from oobleck_hpc.profiling.profile import (Fingerprint, LayerProfile, LinkCost, MachineProfile,
                                           ModelProfile)

MEMORY_EFFICIENCY = 0.7
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float
    fp32_tflops: float
    """Matmul throughput used for float32 (TF32 tensor cores where the device has them)."""
    memory_bytes: int
    hbm_gbs: float
    nvlink_gbs: float
    network_gbs: float
    interconnect: str
    matmul_efficiency: float
    """Fraction of the dense peak a training run reaches (module docstring: its source)."""


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in [
        DeviceSpec("A40", 149.7, 37.4, 48 * 10**9, 696.0, 112.5, 25.0,
                   "NVLink bridge + HDR InfiniBand", 0.115),
        DeviceSpec("A100-80G", 312.0, 156.0, 80 * 10**9, 2039.0, 600.0, 25.0,
                   "NVLink 3 + HDR InfiniBand", 0.5),
        DeviceSpec("H100-80G", 989.0, 494.7, 80 * 10**9, 3350.0, 900.0, 50.0,
                   "NVLink 4 + NDR InfiniBand", 0.5),
    ]
}


@dataclass(frozen=True)
class Measurement:
    """A published training throughput the analytic model is checked against."""

    source: str
    model: str
    device: str
    gpus_per_node: int
    microbatch_size: int
    global_microbatches: int
    samples_per_s: dict[int, float]
    """Node count -> measured samples/s."""
    fit_nodes: int
    """The node count DeviceSpec.matmul_efficiency was calibrated on (the others are held out)."""


OOBLECK_GPT3_6_7B_A40 = Measurement(
    source="SymbioticLab/Oobleck tools/simulator/oobleck_simulator.py (commit e079df1), "
           "gpt_3_6_7b_simulate_step_delta: Oobleck's measured throughput by node count",
    model="gpt3-6.7b", device="A40", gpus_per_node=1, microbatch_size=1,
    global_microbatches=1024,
    samples_per_s={30: 5.507784136, 29: 5.324191332, 28: 5.140598527, 27: 4.957005722,
                   26: 4.773412918, 25: 4.808826127, 24: 4.329925297, 23: 4.185194343,
                   22: 3.947198754, 21: 4.010855553, 20: 4.15443025, 19: 3.71233106,
                   18: 3.593275995, 17: 3.283996229, 16: 3.530908551},
    fit_nodes=30)

# A Llama-like extra (SwiGLU MLP approximated by r = 8/3 * 3/2 = 4 in FLOPs and bytes).
EXTRA_CONFIGS: dict[str, GPTConfig] = {
    "llama-7b-like": GPTConfig("llama-7b-like", n_layer=32, d_model=4096, n_head=32, seq_len=4096,
                               vocab_size=32000),
}


def _model(model: str | GPTConfig | HFArch) -> GPTConfig | HFArch:
    if isinstance(model, (GPTConfig, HFArch)):
        return model
    cfg = GPT_CONFIGS.get(model) or EXTRA_CONFIGS.get(model)
    if cfg is None:
        raise ProfileError(f"no analytic model {model!r}. Fix: use one of "
                           f"{', '.join([*GPT_CONFIGS, *EXTRA_CONFIGS])}, or a Hugging Face "
                           f"config (model.hf)")
    return cfg


@dataclass(frozen=True)
class LayerCounts:
    """What the time and memory of one layer are derived from, per microbatch."""

    name: str
    params: int
    fwd_flops: float
    act: int
    """Bytes of activations kept for the backward pass."""
    out: int
    """Bytes of the output sent to the next layer."""


def _gpt_layers(cfg: GPTConfig, b: int, s: int, e: int) -> list[LayerCounts]:
    """Our GPT family (module docstring, "Model")."""
    d, V, r = cfg.d_model, cfg.vocab_size, cfg.mlp_ratio
    tokens = b * s
    block_params = (4 + 2 * r) * d * d + (9 + r) * d
    return ([LayerCounts("embedding", V * d + s * d, 0.0, tokens * d * e, tokens * d * e)]
            + [LayerCounts(f"block{i}", block_params,
                           2 * tokens * (4 + 2 * r) * d * d + 4 * b * s * s * d,
                           34 * tokens * d * e // 2, tokens * d * e) for i in range(cfg.n_layer)]
            + [LayerCounts("head", 2 * d + d * V, 2 * tokens * d * V,
                           tokens * d * e + 4 * tokens * V, 4)])


def _hf_layers(arch: HFArch, b: int, s: int, e: int) -> list[LayerCounts]:
    """A Hugging Face causal LM (module docstring, "Hugging Face models")."""
    d, V, inner = arch.d_model, arch.vocab_size, arch.n_head * arch.head_dim
    tokens = b * s
    qkv = (arch.n_head + 2 * arch.n_kv_head) * arch.head_dim
    kept = 5 * d + qkv + inner + (4 if arch.gated_mlp else 2) * arch.intermediate
    return ([LayerCounts("embedding", arch.embedding_params(), 0.0, tokens * d * e,
                         tokens * d * e)]
            + [LayerCounts(f"block{i}", arch.block_params(),
                           2 * tokens * arch.block_matrix_params() + 4 * b * s * s * inner,
                           tokens * kept * e, tokens * d * e) for i in range(arch.n_layer)]
            + [LayerCounts("head", arch.head_params(), 2 * tokens * d * V,
                           tokens * d * e + 4 * tokens * V, 4)])


def training_flops_per_sample(model: str | GPTConfig | HFArch, seq_len: int | None = None) -> float:
    """FLOPs of one sample's forward and backward pass (3 x forward: backward = 2 x forward),
    from the counts above: the "model FLOPs" of MFU, no recomputation counted. `seq_len`:
    tokens per sample (default: the model's context length)."""
    cfg = _model(model)
    if isinstance(cfg, HFArch):
        counts = _hf_layers(cfg, 1, seq_len or cfg.max_positions, 2)
    else:
        counts = _gpt_layers(cfg, 1, seq_len or cfg.seq_len, 2)
    return 3.0 * sum(c.fwd_flops for c in counts)


def analytic_profile(model: str | GPTConfig | HFArch, device: str, microbatch_size: int,
                     dtype: str = "bfloat16", gpus_per_node: int = 8,
                     matmul_efficiency: float | None = None, name: str | None = None,
                     seq_len: int | None = None) -> ModelProfile:
    """Per-layer profile of a model on `device` (one of DEVICES), from the equations above: a
    GPT config (or its name) or a Hugging Face architecture (`name` labels it; default its
    model_type). `seq_len`: tokens per sample (default: the model's context length).
    `matmul_efficiency` replaces the device's own (bench/calibrate.py fits it)."""
    cfg = _model(model)
    if device not in DEVICES:
        raise ProfileError(f"no analytic device {device!r}. Fix: use one of {', '.join(DEVICES)}")
    if dtype not in ("bfloat16", "float32"):
        raise ProfileError(f"analytic dtype {dtype!r} is not supported. Fix: bfloat16 or float32")
    if microbatch_size < 1 or gpus_per_node < 1:
        raise ProfileError("analytic profile: microbatch_size and gpus_per_node must be >= 1")
    dev = DEVICES[device]
    e = 2 if dtype == "bfloat16" else 4
    eff = dev.matmul_efficiency if matmul_efficiency is None else matmul_efficiency
    if not 0 < eff <= 1:
        raise ProfileError(f"analytic profile: matmul_efficiency {eff} must be in (0, 1]")
    flops = (dev.bf16_tflops if dtype == "bfloat16" else dev.fp32_tflops) * 1e12 * eff
    hbm = dev.hbm_gbs * 1e9 * MEMORY_EFFICIENCY

    def layer(c: LayerCounts) -> LayerProfile:
        traffic = 2 * c.act + c.out  # written in forward, read (and gradient written) in backward
        fwd = 1000.0 * (c.fwd_flops / flops + c.act / hbm)
        bwd = 1000.0 * (2 * c.fwd_flops / flops + traffic / hbm)
        return LayerProfile(c.name, fwd, bwd, 4 * c.params, 4 * c.params, 8 * c.params,
                            int(c.act), int(c.out))

    if isinstance(cfg, HFArch):
        counts = _hf_layers(cfg, microbatch_size, seq_len or cfg.max_positions, e)
        model_name = name or cfg.model_type
    else:
        counts = _gpt_layers(cfg, microbatch_size, seq_len or cfg.seq_len, e)
        model_name = name or cfg.name
    nvl = LinkCost(0.01, dev.nvlink_gbs * 1e9 * LINK_EFFICIENCY)
    net = LinkCost(0.02, dev.network_gbs * 1e9 * LINK_EFFICIENCY)
    machine = MachineProfile(dev.name, dev.memory_bytes, gpus_per_node, nvl, net, nvl, net,
                             interconnect=dev.interconnect)
    fp = Fingerprint(model_name, cfg.arch_hash(), microbatch_size, dtype, dev.name, gpus_per_node,
                     dev.interconnect, source="analytic", tool_version="oobleck_hpc analytic 2",
                     created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return ModelProfile(fp, machine, tuple(layer(c) for c in counts))
