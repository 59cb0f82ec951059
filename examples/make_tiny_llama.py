"""Write examples/models/tiny-llama/config.json: a tiny random Llama for the CPU (no download).

Run from the repository root: `python examples/make_tiny_llama.py [OUT_DIR]` (needs the hf
extra: `pip install -e '.[hf]'`). The config is what `LlamaConfig(...).save_pretrained` writes --
the same file a Llama 2/3 checkpoint ships, only small: 6 decoder blocks of width 64 with
grouped-query attention (4 query heads, 2 key/value heads), SwiGLU, RMSNorm, rotary positions,
tied input/output embeddings, and a vocabulary of 256 ids so the job's default byte-level
tokenizer fits it. `examples/llama-tiny-local.yaml` trains it; the file is shipped too, so a
fresh clone needs no step of this script. Make your own model the same way (any supported
model_type: llama, mistral, qwen2, gpt2, gpt_neox), or point `model.hf` at a downloaded
model's directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import LlamaConfig

OUT = Path(__file__).resolve().parent / "models" / "tiny-llama"


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,               # byte-level data (the job's default tokenizer)
        hidden_size=64,
        intermediate_size=172,        # SwiGLU's ~8/3 x hidden
        num_hidden_layers=6,          # the layer list: embedding | 6 blocks | norm + head
        num_attention_heads=4,
        num_key_value_heads=2,        # grouped-query attention
        max_position_embeddings=64,   # the job's sequence length (data.seq_len's default)
        rope_theta=10000.0,
        tie_word_embeddings=True,     # exact on any plan: both copies' gradients are summed
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    tiny_llama().save_pretrained(out)
    print(f"wrote {out / 'config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
