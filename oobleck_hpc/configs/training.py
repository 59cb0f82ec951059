"""The job file's sections about what is trained: `model`, `data`, `train`.

Part of the job file's dataclasses (config.py imports them from here; import them from
`oobleck_hpc.config`). Every default is the field's own, declared once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from oobleck_hpc.schema import Where as _Where


@dataclass
class ModelConfig:
    name: str = "gpt-tiny"
    """A model of the built-in GPT family (gpt-tiny, gpt2-small, gpt3-350m ... gpt3-175b),
    or a label for the user's own model when `factory` or `hf` is set."""
    factory: str | None = None
    """`package.module:function` returning the user's own layer list (see oobleck_hpc/models)."""
    hf: str | None = None
    """A directory holding a Hugging Face config.json (llama, mistral, qwen2, gpt2, gpt_neox:
    models/hf_config.py), cut into layers with transformers' own modules (`pip install
    'oobleck_hpc[hf]'`); dropout off, so a step is a pure function of weights and batch."""
    weights: str | None = None
    """Pretrained weights of the model.hf model: a directory holding `model.safetensors` or
    shards with `model.safetensors.index.json` (as save_pretrained writes them). A layer built
    fresh at the start of a run is read from them (each rank reads only its layers' tensors);
    a checkpoint's or a surviving replica's state still wins (models/hf_weights.py)."""
    seed: int = 0
    """Every layer is built from (seed, layer index): replicas start bit-identical."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """float32: parameters and compute in fp32; bfloat16: fp32 parameters, autocast to bf16 for
    the compute; float64: the model is built in fp64 -- for exact comparisons with the fp64
    single-process reference (`engine.reference_run`; tests, `oobleck-hpc chaos`). A float64 job
    is profiled and planned as its float32 twin (`profile_dtype`): same profile, same plan."""

    @property
    def profile_dtype(self) -> str:
        """The dtype the job's profile is measured in and looked up by (float64 -> float32)."""
        return "float32" if self.dtype == "float64" else self.dtype

    def check(self, where: _Where) -> None:
        from oobleck_hpc.models.configs import check_model  # pure data, no torch

        check_model(self, where)


@dataclass
class DataConfig:
    corpus: str = "stdlib"
    """'stdlib' (the Python standard library's source files: real text on every machine, no
    download) or a path to a UTF-8 text file or a directory of them."""
    tokenizer: str | None = None
    """A directory holding a Hugging Face tokenizer.json (and optionally tokenizer_config.json,
    whose eos_token joins the corpus's files): the corpus is tokenised with it (needs `pip
    install 'oobleck_hpc[hf]'`). Unset: byte-level, 256 ids. Its vocabulary must not be larger
    than the model's."""
    tokens: str | None = None
    """Pre-tokenized data used in place instead of `corpus` (memory-mapped, never copied):
    FILE.bin (a flat token file as nanoGPT writes it; set `dtype`), FILE.npy (a 1-D integer
    array), or PREFIX.idx of a Megatron-LM indexed dataset (PREFIX.bin beside it). Every id
    must be below the model's vocabulary size (oobleck_hpc/data/pretokenized.py)."""
    dtype: Literal["uint16", "uint32"] | None = None
    """The token type of a flat .bin in `tokens` (it has no header to say it): uint16 (nanoGPT,
    GPT-2's vocabulary) or uint32. .npy and Megatron files state their own."""
    seq_len: int | None = None
    """Tokens per sample; defaults to the model's context length."""
    cache_dir: str = ".cache/oobleck_hpc"
    """Where the tokenised corpus is memory-mapped from (tokenised once, reused by every node),
    and where the id range of a pre-tokenized file is remembered once scanned."""

    def check(self, where: _Where) -> None:
        if self.seq_len is not None and self.seq_len < 2:
            where.fail("seq_len", self.seq_len, "must be at least 2", "use e.g. 64")
        suffix = Path(self.tokens).suffix if self.tokens is not None else None
        if suffix is not None and suffix not in (".bin", ".npy", ".idx"):
            where.fail("tokens", self.tokens, "has none of the suffixes .bin, .npy, .idx",
                       "give FILE.bin (with dtype), FILE.npy, or the PREFIX.idx of a Megatron "
                       "indexed dataset")
        if suffix is not None and self.corpus != "stdlib":
            where.fail("tokens", self.tokens, f"is given beside corpus {self.corpus!r}",
                       "keep one: tokens (pre-tokenized) or corpus (text)")
        if suffix == ".bin" and self.dtype is None:
            where.fail("dtype", None, "is required for a flat .bin in tokens (no header says "
                       "its type)", "write dtype: uint16 (as nanoGPT writes) or uint32")
        if suffix != ".bin" and self.dtype is not None:
            where.fail("dtype", self.dtype, "applies to a flat .bin in tokens only",
                       "remove it (.npy and Megatron files state their own type)")


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run (the job's end; a resumed job continues to this same number)."""
    microbatch_size: int = 2
    """Samples per microbatch (the unit the pipelines schedule and the profile was measured at)."""
    global_microbatches: int = 16
    """Global batch in microbatches; fixed for the whole job, re-split across pipelines on failure."""
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    """Clip by the global gradient norm over all layers (0 disables)."""
    log_every: int = 5
    """Outside a TTY: one log line every this many steps."""
    save_final_params: bool = False
    """After the last step the lowest holder of each layer writes that layer's parameters to
    RUN_DIR/final/layer-<i>.pt (a dict name -> tensor), to compare a run with a reference."""
    recompute: bool = False
    """Activation recomputation: each layer keeps only its input for the backward pass and runs
    its forward again there (torch.utils.checkpoint): less activation memory, about one more
    forward per step. The planner accounts for both (planning/cost.py, `with_recompute`)."""

    def check(self, where: _Where) -> None:
        for key in ("steps", "microbatch_size", "global_microbatches"):
            if getattr(self, key) < 1:
                where.fail(key, getattr(self, key), "must be at least 1", "use a positive integer")
        if self.lr <= 0:
            where.fail("lr", self.lr, "must be positive", "use e.g. 3e-4")
        if not 0 <= self.min_lr <= self.lr:
            where.fail("min_lr", self.min_lr, f"must lie in [0, lr={self.lr}]", "lower it")
        if self.warmup_steps < 0:
            where.fail("warmup_steps", self.warmup_steps, "must be >= 0", "use 0 for no warm-up")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            where.fail("betas", list(self.betas), "must be two numbers in [0, 1)", "use [0.9, 0.95]")
        if self.grad_clip < 0:
            where.fail("grad_clip", self.grad_clip, "must be >= 0", "use 0 to disable clipping")
        if self.log_every < 1:
            where.fail("log_every", self.log_every, "must be at least 1", "use e.g. 5")
