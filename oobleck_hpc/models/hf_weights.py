"""Pretrained weights in, standard weights out: safetensors files as `save_pretrained` writes
them (the only module importing safetensors, an optional dependency: `pip install
'oobleck_hpc[hf]'`).

In (`model.weights: DIR`): DIR holds `model.safetensors`, or shards named by
`model.safetensors.index.json` (its `weight_map`: tensor name -> file). `Weights(DIR)` reads the
index and the files' headers only (8-byte length + JSON: name -> dtype, shape, offsets), so the
job's check (`check_weights`, run by the launcher before any node starts and by every rank
before it loads) names a missing tensor or a wrong shape, and its file, without reading a byte
of tensor data. `Weights.load_layer` then copies a layer's tensors into its allocated module
one at a time, each read from the memory-mapped file (`safe_open(...).get_slice(name)[:]`): a
rank reads only the tensors of the layers it builds, and holds at most one tensor beside them
while it loads (bench/hf_weights.py measures it).
`Weights.read` records every name read (what a test checks).

Names: a layer's parameter maps to its Hugging Face state-dict name (`HFModel.hf_names`); a
file written from the bare base model (no `model.` / `transformer.` prefix, as GPT-2's
original checkpoint) is accepted too. The second copy of a tied tensor (the LM head of a model
with tie_word_embeddings) is read from the embedding's name when the file does not hold it
(save_pretrained writes a tied tensor once).

Out (`save_hf_weights`): a state dict written as safetensors shards of at most `max_shard_bytes`
(5 GB, as transformers) named `model-0000i-of-0000n.safetensors` with their index, or one
`model.safetensors` when it fits.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from oobleck_hpc.errors import ConfigError

if TYPE_CHECKING:
    from oobleck_hpc.models.hf import HFModel

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9
KEY = "model.weights"


def read_header(path: Path, source: str) -> dict[str, list[int]]:
    """The tensors of a safetensors file: name -> shape (its JSON header only)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ConfigError(source, KEY, f"{path} is not a readable safetensors file ({e})",
                          "give the directory save_pretrained wrote (safe_serialization)") from e
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


class Weights:
    """A directory of safetensors weights (module docstring): names, shapes, files."""

    def __init__(self, directory: str | Path, source: str = "<job>"):
        self.directory = Path(directory)
        self.source = source
        self.read: list[str] = []
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(source, KEY, f"{index} is not a safetensors index ({e!r})",
                                  "give the index save_pretrained wrote") from e
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = [SINGLE]
        else:
            raise ConfigError(source, KEY, f"value {str(directory)!r} holds neither {SINGLE} nor "
                              f"{INDEX}", "name the directory save_pretrained wrote the "
                              "model's weights to (safetensors)")
        self.shapes: dict[str, list[int]] = {}
        self.file: dict[str, Path] = {}
        for name in files:
            for tensor, shape in read_header(self.directory / name, source).items():
                self.shapes[tensor], self.file[tensor] = shape, self.directory / name

    def _name(self, name: str, prefix: str) -> str | None:
        """`name` as the files hold it: as is, or without the base model's prefix."""
        if name in self.shapes:
            return name
        bare = name.removeprefix(prefix + ".")
        return bare if bare in self.shapes else None

    def layer_names(self, model: HFModel, index: int) -> dict[str, str]:
        """Layer `index`'s parameters: our name -> the name in the files (ConfigError naming
        the tensor missing from them)."""
        prefix = model.meta_model().base_model_prefix
        tied = {(j, b): model.hf_names(i)[a] for (i, a), (j, b) in model.tied_parameters()}
        out = {}
        for ours, hf in model.hf_names(index).items():
            found = self._name(hf, prefix)
            if found is None and (index, ours) in tied:
                found = self._name(tied[(index, ours)], prefix)
            if found is None:
                raise ConfigError(self.source, KEY, f"tensor {hf!r} (layer {index}) is in none "
                                  f"of the files of {self.directory} "
                                  f"({', '.join(sorted({p.name for p in self.file.values()}))})",
                                  "give the weights of the model of model.hf (the same "
                                  "config.json)")
            out[ours] = found
        return out

    def check_layer(self, model: HFModel, index: int, module: nn.Module) -> dict[str, str]:
        """`layer_names`, and every tensor's shape that of the layer's parameter."""
        names = self.layer_names(model, index)
        for ours, p in module.named_parameters():
            got = self.shapes[names[ours]]
            if list(p.shape) != list(got):
                raise ConfigError(self.source, KEY, f"tensor {names[ours]!r} of "
                                  f"{self.file[names[ours]]} has shape {list(got)}, the model's "
                                  f"layer {index} needs {list(p.shape)}", "give the weights of "
                                  "the model of model.hf (the same config.json)")
        return names

    def check(self, model: HFModel) -> None:
        """Every layer's tensors present with their shapes: headers only, nothing loaded."""
        for index in range(model.num_layers):
            self.check_layer(model, index, model.build_layer(index, "meta"))

    @torch.no_grad()
    def load_layer(self, model: HFModel, index: int, module: nn.Module) -> None:
        """Copy layer `index`'s tensors into `module` (allocated), one memory-mapped tensor at a
        time, cast to the module's dtype."""
        from safetensors import safe_open

        names = self.check_layer(model, index, module)
        by_file: dict[Path, list[str]] = {}
        for ours in names:
            by_file.setdefault(self.file[names[ours]], []).append(ours)
        for path, ours_list in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for ours in ours_list:
                    # get_slice reads the tensor's bytes only (get_tensor, for torch, reads the
                    # whole file: safetensors 0.8's UntypedStorage.from_file)
                    module.get_parameter(ours).copy_(f.get_slice(names[ours])[:])
                    self.read.append(names[ours])


def save_hf_weights(state: Mapping[str, torch.Tensor], out: Path,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write `state` (HF name -> tensor) into directory `out` as transformers does (module
    docstring); returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(files, shards):
        save_file(shard, str(out / name), metadata=meta)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {k: name for name, shard in zip(files, shards) for k in shard}}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files + [INDEX]
