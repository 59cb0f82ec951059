"""Peak memory of a rank loading pretrained weights (issue 29: <= 1.2 x the size of the layers it
holds plus its steady training state).

A random wide Llama (a few hundred MB, fp32) is saved with save_pretrained in a temporary
directory; a fresh process (the "rank") then imports everything, builds only some of its
layers with `model.weights` (models/hf_weights.py: memory-mapped, one tensor at a time), and
runs one training step on them (forward, backward, AdamW). Reported, in bytes above the
process's resident size before it loaded anything:

    layer_bytes            the parameters of the layers the rank holds
    steady_state_bytes     parameters + gradients + AdamW's two moments (4 x layer_bytes)
    peak_load_bytes        peak resident size while loading (VmHWM)
    peak_step_bytes        peak resident size through the training step
    load_ratio             peak_load_bytes / layer_bytes (the layers + one tensor at a time)
    ratio                  peak_load_bytes / steady_state_bytes   (target <= 1.2)
    step_ratio             peak_step_bytes / steady_state_bytes (the step's own peak, for scale:
                           AdamW's temporaries, not loading)
    model_file_bytes       the whole model's safetensors, never read whole by the rank

    python bench/hf_weights.py [--hidden 1024] [--layers 6] [--hold 1:4] [--sharded]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """The process's peak resident size since `reset_peak` (VmHWM; ru_maxrss would include the
    parent's peak, which Linux carries across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the resident size now


def rank(directory: str, start: int, end: int) -> dict:
    import torch

    from oobleck_hpc.models.hf import HFModel

    model = HFModel(directory, weights=directory)
    model.meta_model()
    reset_peak()
    base = rss()
    layers = [model.build_layer(i) for i in range(start, end)]
    load_peak = peak() - base
    layer_bytes = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-4)
    h = (torch.randint(0, model.arch.vocab_size, (1, 32)) if start == 0
         else torch.randn(1, 32, model.arch.d_model))
    for m in layers:
        h = m(h)
    h.square().mean().backward()
    opt.step()
    return {"layers": [start, end], "layer_bytes": layer_bytes,
            "steady_state_bytes": 4 * layer_bytes, "peak_load_bytes": load_peak,
            "peak_step_bytes": peak() - base, "read_tensors": len(model.weights.read)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hold", default="1:4", help="the rank's layers START:END (0 = embedding)")
    ap.add_argument("--sharded", action="store_true", help="save in 100 MB shards")
    ap.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    start, end = map(int, args.hold.split(":"))
    if args.rank:
        print(json.dumps(rank(args.rank, start, end)))
        return

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                             intermediate_size=int(2.75 * args.hidden),
                             num_hidden_layers=args.layers, num_attention_heads=16,
                             num_key_value_heads=4, max_position_embeddings=128)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, max_shard_size="100MB" if args.sharded else "5GB")
        del model
        size = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors"))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        out = subprocess.run([sys.executable, __file__, "--rank", tmp, "--hold", args.hold],
                             capture_output=True, text=True, env=env, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result.update(model_file_bytes=size, sharded=args.sharded,
                  load_ratio=round(result["peak_load_bytes"] / result["layer_bytes"], 3),
                  ratio=round(result["peak_load_bytes"] / result["steady_state_bytes"], 3),
                  step_ratio=round(result["peak_step_bytes"] / result["steady_state_bytes"], 3))
    result["ok"] = result["ratio"] <= 1.2
    print(json.dumps(result))


if __name__ == "__main__":
    main()
