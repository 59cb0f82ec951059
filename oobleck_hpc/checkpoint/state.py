"""The state a checkpoint holds, in memory: a layer's state dict and the training state.

- `layer_state` / `load_layer_state`: a (module, AdamW) pair as a flat `LayerState`
  (`param/<name>`, `buffer/<name>`, `optim/<name>/<key>` tensors) and back, strictly;
- `TrainState`: step, data cursor, LR schedule, RNG states, plan; `split_train_state` /
  `join_train_state` turn it into a JSON part and a tensor part (the shard format stores both);
- `capture_rng` / `restore_rng`: Python's, NumPy's and torch's generators.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from oobleck_hpc.errors import CheckpointError

LayerState = dict[str, torch.Tensor]


def layer_state(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> LayerState:
    """The layer's state as `param/<name>`, `buffer/<name>`, `optim/<name>/<key>` tensors.

    Returns references, not copies (Checkpointer.save snapshots them). `optimizer` may hold the
    parameters of several layers (one AdamW per stage): only this module's parameters are read.
    """
    out: LayerState = {}
    for name, p in module.named_parameters():
        out[f"param/{name}"] = p.detach()
        if optimizer is not None and p in optimizer.state:
            for key, value in optimizer.state[p].items():
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value, dtype=torch.float32)
                out[f"optim/{name}/{key}"] = value.detach()
    for name, b in module.named_buffers():
        if _is_persistent(module, name):
            out[f"buffer/{name}"] = b.detach()
    return out


def load_layer_state(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                     state: Mapping[str, torch.Tensor], *, layer: int | str = "?") -> None:
    """Apply a `layer_state` dict to a module (and its parameters' state in `optimizer`).

    Strict: every parameter and persistent buffer must be present with its shape, and no key may be
    left over; a parameter without `optim/` entries gets an empty optimizer state (as before its
    first step). Optimizer tensors move to the parameter's device; `step` stays a CPU tensor unless
    the param group is `capturable` or `fused` (as torch's own Optimizer.load_state_dict does).
    """
    used: set[str] = set()
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            key = f"param/{name}"
            _copy_checked(p, state, key, layer)
            used.add(key)
        for name, b in module.named_buffers():
            if _is_persistent(module, name):
                key = f"buffer/{name}"
                _copy_checked(b, state, key, layer)
                used.add(key)
    if optimizer is not None:
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for name, p in params.items():
            if id(p) not in groups:
                raise CheckpointError(f"layer {layer}: parameter {name!r} is not in the optimizer")
            prefix = f"optim/{name}/"
            entries = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            group = groups[id(p)]
            on_param_device = group.get("capturable", False) or group.get("fused", False)
            new_state = {}
            for key, value in entries.items():
                if key == "step" and not on_param_device:
                    new_state[key] = value.to(device="cpu", dtype=torch.float32, copy=True)
                else:
                    new_state[key] = value.to(device=p.device, copy=True)
                used.add(prefix + key)
            optimizer.state.pop(p, None)
            if new_state:
                optimizer.state[p] = new_state
    leftover = sorted(set(state) - used)
    if optimizer is None:
        leftover = [k for k in leftover if not k.startswith("optim/")]
    if leftover:
        raise CheckpointError(f"layer {layer}: the checkpoint has state for {leftover[:5]} that the "
                              f"module does not have (a different model or layer order?)")


def _copy_checked(dst: torch.Tensor, state: Mapping[str, torch.Tensor], key: str, layer: Any) -> None:
    if key not in state:
        raise CheckpointError(f"layer {layer}: the checkpoint has no {key!r} "
                              f"(it has {sorted(state)[:5]}...); was it written for another model?")
    src = state[key]
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"layer {layer}: {key!r} has shape {tuple(src.shape)} in the checkpoint "
                              f"but {tuple(dst.shape)} in the model")
    dst.copy_(src)


def _is_persistent(module: nn.Module, dotted: str) -> bool:
    owner_name, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return leaf not in owner._non_persistent_buffers_set


# ----------------------------------------------------------------------------- training state


@dataclass
class TrainState:
    """Everything besides the layers that an exact resume needs."""

    step: int
    """Optimizer steps completed; the resumed job runs step `step` next."""
    samples_seen: int = 0
    """Data cursor: global samples consumed so far (the next batch starts here)."""
    lr_schedule: dict[str, Any] = field(default_factory=dict)
    """State of the LR schedule (JSON-able, e.g. a scheduler's state_dict())."""
    rng: dict[str, Any] = field(default_factory=dict)
    """RNG states, from `capture_rng()`."""
    plan: dict[str, Any] | None = None
    """The plan that wrote the checkpoint (Plan.to_dict()), for the record."""
    plan_digest: str = ""
    generation: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else JSON-able the training loop wants back."""


def capture_rng() -> dict[str, Any]:
    """States of Python's, NumPy's and torch's (CPU and CUDA) default generators."""
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _jsonable(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def split_train_state(ts: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """JSON part and tensor part (tensors found anywhere in rng / lr_schedule / extra)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x
            return {"__tensor__": path}
        if isinstance(x, Mapping):
            return {str(k): walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
        return x

    meta = walk(asdict(ts), "train")
    json.dumps(meta)  # fail here, in the caller, on a non-JSON-able value
    return meta, tensors


def join_train_state(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> TrainState:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                return tensors[x["__tensor__"]]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return TrainState(**walk(meta))

