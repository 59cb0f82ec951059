"""Checkpoints sharded by layer: asynchronous, atomic, verifiable, restorable onto any plan.

What a checkpoint holds
-----------------------
One file per model layer (the layer's parameters, buffers and AdamW state) and one file for the
training state (step, sample cursor, LR-schedule state, RNG states, plan, generation). A layer is
written ONCE, by one owner among the ranks that hold a replica of it (`shard_owners`); the training
state is written by rank `train_state_owner(plan)`. Because nothing in the files depends on the plan
that wrote them, a checkpoint restores onto ANY plan and node count: each rank of the new plan reads
only the layers it holds now (`Checkpoint.layer(i)`).

The per-layer state is a flat `dict[str, torch.Tensor]` (the interface the engine produces and
consumes; `layer_state` / `load_layer_state` build and apply it for a (module, AdamW) pair):

    param/<name>                   a parameter of the layer module (module.named_parameters())
    buffer/<name>                  a persistent buffer (module.named_buffers(), if any)
    optim/<name>/<key>             the optimizer state of param <name>: exp_avg, exp_avg_sq, step
                                   (absent for a parameter the optimizer has not stepped yet)

Layout on disk (`checkpoint.dir`, a shared filesystem)
------------------------------------------------------
    step-<N>.tmp.<attempt>.<tag>/  being written: shard files + one completion record per writer
        layer-<i>.bin                (fsynced before its record is written)
        train.bin
        done-rank<r>.json            files, sizes, sha256 of what rank r wrote (atomic, fsynced)
    step-<N>/                      published: the same files + MANIFEST.json
    latest                         "step-<N>": the newest published checkpoint (atomic replace)

`attempt` names one run of the job (SLURM_JOB_ID.SLURM_RESTART_COUNT, or OOBLECK_ATTEMPT set by the
local launcher) and `tag` the plan the writers share (generation + plan digest), so that leftovers
of a crashed run or of an older plan are never mixed into a new checkpoint of the same step.

Writing (no coordinator, no network)
------------------------------------
`Checkpointer.save(step, shards, train_state)` copies the tensors into this rank's host buffers (the
only part that blocks training; the buffers are allocated by the first save -- pinned when the
tensors are on a GPU -- and reused, since one save is in flight at a time) and returns; a
background thread then, for this rank:

1. writes each shard file (header + raw tensor bytes), hashing while writing, and fsyncs it;
2. writes its completion record `done-rank<r>.json` (temp file, fsync, rename, fsync directory);
3. reads all completion records of the directory. The writer that sees every layer 0..L-1 and the
   training state complete publishes: it writes MANIFEST.json (deterministic: built from the
   records, so two concurrent publishers write the same bytes), fsyncs the directory, renames
   `step-<N>.tmp...` -> `step-<N>` (atomic; a second publisher's rename finds no source and stops),
   fsyncs the parent, atomically replaces `latest` (temp + fsync + rename) and prunes to the newest
   `keep` checkpoints (rename to `*.deleting` first, then delete, so a half-deleted directory is
   never taken for a checkpoint).

With `save(..., defer_copy=True)` even the copy leaves the critical path: it runs in the
background during the next forward and backward (which only read parameters and optimizer state),
and the engine calls `fence()` before `optimizer.step()` (CheckFreq's split of snapshot and persist,
Mohan et al., FAST'21). bench/checkpoint.py measures both modes.

A crash at any moment leaves at worst an unpublished `*.tmp*` directory (removed by a later publish)
and the previous `step-<M>` untouched: a directory is only ever called `step-<N>` after every file in
it and its manifest are durable.

Loading
-------
`find_latest(root)` walks the published checkpoints newest first and returns the first whose files
all match the manifest (size and sha256); a partial or corrupt one is refused with a message naming
the file and what is wrong, and the previous one is used (the reasons are kept in `.skipped`).
A refused checkpoint is renamed `step-<N>.refused-<time>` (kept for a person to look at), so the
resumed run's own checkpoints become the newest again. The directory scan, not `latest`, decides:
`latest` is for people and tools, and lags by one checkpoint only if a crash fell between the
rename and its update (the next publish repairs it). Every rank must restore the SAME step: verify
on one rank and broadcast the step (then `open_checkpoint(root, step, verify=False)` elsewhere), or
let every rank run `find_latest` (deterministic for the same files, but every rank then reads every
file). `Checkpoint.layer(i)` verifies the checksum of what it reads in any case.

Leaving for a requeue (GuaranteeExceeded, USR2 before the time limit, SIGTERM on preemption):
`StopSignals.install()` makes the signals set a flag read at step boundaries, and
`checkpoint_and_requeue(...)` saves, waits until the checkpoint is published, asks Slurm to requeue
(`scontrol requeue`) and returns errors.EXIT_REQUEUE (75) for `sys.exit`; see the section near the
end of this file.

Periodic saving (`Checkpointer.due`) is by steps and/or minutes (`CheckpointConfig`). All ranks
must save the same steps: the step rule is identical everywhere; the minutes rule reads a local
clock, so with several ranks the caller must agree on it (e.g. take the max of the ranks' `due`
flags in the step's all-reduce) before calling `save`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from oobleck_hpc.errors import EXIT_REQUEUE, OobleckError

if TYPE_CHECKING:
    from oobleck_hpc.config import CheckpointConfig
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.profiling.profile import ModelProfile

FORMAT_VERSION = 1
_MAGIC = b"OOBLCKPT"
_ALIGN = 64
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp\.")
LayerState = dict[str, torch.Tensor]


class CheckpointError(OobleckError):
    """A checkpoint is missing, partial or corrupt, or a state does not fit the model."""


# ----------------------------------------------------------------------------- ownership


def shard_owners(plan: Plan, profile: ModelProfile | None = None) -> dict[int, int]:
    """layer -> the one rank (among the layer's replicas) that writes it into a checkpoint.

    Deterministic (every rank computes the same map) and balanced: layers are taken from the
    largest to the smallest (bytes of parameters + optimizer state from `profile`, else equal
    weights) and each goes to the replica whose node has written the fewest bytes so far (a node's
    link to the shared filesystem is the bottleneck), then the rank with the fewest bytes, then the
    lowest rank.
    """
    n = plan.num_layers
    if profile is not None and profile.num_layers != n:
        raise CheckpointError(f"profile has {profile.num_layers} layers but the plan has {n}")
    weight = [profile.layers[i].state_bytes if profile is not None else 1 for i in range(n)]
    node_of = {r.rank: r.node for r in plan.ranks}
    node_bytes: dict[str, int] = {}
    rank_bytes: dict[int, int] = {}
    owners: dict[int, int] = {}
    for layer in sorted(range(n), key=lambda i: (-weight[i], i)):
        candidates = plan.layer_owners(layer)
        if not candidates:
            raise CheckpointError(f"layer {layer} has no replica in plan generation {plan.generation}")
        best = min(candidates, key=lambda r: (node_bytes.get(node_of[r], 0), rank_bytes.get(r, 0), r))
        owners[layer] = best
        node_bytes[node_of[best]] = node_bytes.get(node_of[best], 0) + weight[layer]
        rank_bytes[best] = rank_bytes.get(best, 0) + weight[layer]
    return dict(sorted(owners.items()))


def train_state_owner(plan: Plan) -> int:
    """The rank that writes the training state (the same on every rank: rank 0)."""
    del plan
    return 0


def plan_tag(plan: Plan) -> str:
    """A tag every rank of `plan` computes identically (see Checkpointer.save)."""
    return f"g{plan.generation}-{plan.digest()}"


# ----------------------------------------------------------------------------- layer state


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


def _split_train_state(ts: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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


def _join_train_state(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> TrainState:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                return tensors[x["__tensor__"]]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return TrainState(**walk(meta))


# ----------------------------------------------------------------------------- shard files


def _write_shard(path: Path, tensors: Mapping[str, torch.Tensor], meta: Any = None) -> dict[str, Any]:
    """Write header + raw tensor bytes, fsync; return {size, sha256} of the file's bytes.

    Format: 8-byte magic, 8-byte little-endian header length, JSON header, then each tensor's bytes
    at a 64-byte aligned offset. No pickle: loading never executes code from the file.
    """
    entries, offset = [], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    header = json.dumps({"format": FORMAT_VERSION, "meta": meta, "tensors": entries}).encode()
    start = -(-(16 + len(header)) // _ALIGN) * _ALIGN
    head = _MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (start - len(head))
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in _chunks(head, tensors, entries):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _chunks(head: bytes, tensors: Mapping[str, torch.Tensor], entries: list[dict]):
    yield head
    for e in entries:
        t = tensors[e["key"]]
        if e["nbytes"]:
            yield memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        pad = -e["nbytes"] % _ALIGN
        if pad:
            yield b"\0" * pad


def _read_shard(path: Path, expect: Mapping[str, Any] | None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Read a shard file, check size and sha256 against `expect`, return (meta, tensors)."""
    try:
        size = path.stat().st_size
        buf = bytearray(size)
        with open(path, "rb") as f:
            got = f.readinto(buf)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    if got != size:
        raise CheckpointError(f"{path}: read {got} of {size} bytes")
    if expect is not None:
        if size != expect["size"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {expect['size']} "
                                  f"(truncated or overwritten)")
        sha = hashlib.sha256(buf).hexdigest()
        if sha != expect["sha256"]:
            raise CheckpointError(f"{path}: sha256 {sha[:16]}... differs from the manifest's "
                                  f"{expect['sha256'][:16]}... (the file is corrupt)")
    if size < 16 or bytes(buf[:8]) != _MAGIC:
        raise CheckpointError(f"{path}: not a checkpoint shard (bad magic)")
    hlen = int.from_bytes(buf[8:16], "little")
    try:
        header = json.loads(bytes(buf[16:16 + hlen]))
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable header ({e})") from e
    start = -(-(16 + hlen) // _ALIGN) * _ALIGN
    tensors = {}
    data = memoryview(buf)[start:]
    for e in header["tensors"]:
        dtype = getattr(torch, e["dtype"])
        raw = data[e["offset"]:e["offset"] + e["nbytes"]]
        if len(raw) != e["nbytes"]:
            raise CheckpointError(f"{path}: tensor {e['key']!r} runs past the end of the file")
        t = torch.frombuffer(raw, dtype=dtype) if e["nbytes"] else torch.empty(0, dtype=dtype)
        tensors[e["key"]] = t.reshape(e["shape"])
    return header["meta"], tensors


# ----------------------------------------------------------------------------- small fs helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `path` so that it is either absent/old or complete: temp file, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _published_steps(root: Path) -> list[int]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64] or "_"


def default_attempt() -> str:
    """Names this run of the job: OOBLECK_ATTEMPT (set by the local launcher), else Slurm's job id
    and restart count, else "0"."""
    if os.environ.get("OOBLECK_ATTEMPT"):
        return os.environ["OOBLECK_ATTEMPT"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return "0"


# ----------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A published checkpoint directory and its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.manifest["num_layers"])

    def verify(self, full: bool = True) -> None:
        """Check every file against the manifest: sizes always, sha256 too when `full`."""
        for name, expect in self.manifest["files"].items():
            path = self.path / name
            try:
                size = path.stat().st_size
            except OSError as e:
                raise CheckpointError(f"{path}: missing ({e.strerror}); the checkpoint is partial") from e
            if size != expect["size"]:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says {expect['size']}")
            if full:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                if h.hexdigest() != expect["sha256"]:
                    raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt file)")

    def layer(self, index: int) -> LayerState:
        """Layer `index`'s state (checksum verified while reading)."""
        name = self.manifest["layers"].get(str(index))
        if name is None:
            raise CheckpointError(f"{self.path}: no layer {index} (it has {self.num_layers} layers)")
        _, tensors = _read_shard(self.path / name, self.manifest["files"][name])
        return tensors

    def train_state(self) -> TrainState:
        name = self.manifest["train"]
        meta, tensors = _read_shard(self.path / name, self.manifest["files"][name])
        return _join_train_state(meta, tensors)


def open_checkpoint(root: str | Path, step: int, verify: bool = True) -> Checkpoint:
    """The published checkpoint of `step` under `root`; CheckpointError if it is absent, partial
    or (with `verify`) corrupt."""
    path = Path(root) / f"step-{step}"
    try:
        manifest = json.loads((path / "MANIFEST.json").read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no MANIFEST.json; not a published checkpoint") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/MANIFEST.json: unreadable ({e})") from e
    if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
        raise CheckpointError(f"{path}/MANIFEST.json: format {manifest.get('format')} step "
                              f"{manifest.get('step')}, expected format {FORMAT_VERSION} step {step}")
    ckpt = Checkpoint(path, step, manifest)
    if verify:
        ckpt.verify(full=True)
    return ckpt


@dataclass
class LatestResult:
    checkpoint: Checkpoint | None
    skipped: list[str]
    """Why newer checkpoints were refused (one message each)."""


def find_latest(root: str | Path, verify: bool = True, quarantine: bool = True) -> LatestResult:
    """The newest published checkpoint that verifies, falling back past partial or corrupt ones.

    `checkpoint` is None when `root` holds no good checkpoint (a fresh start); `skipped` says why
    each newer one was refused. With `quarantine` (the default for a job that resumes), a refused
    checkpoint is renamed `step-<N>.refused-<time>` (kept for inspection, no longer a
    checkpoint): otherwise it would stay the newest step, and the resumed run's own checkpoints
    would be pruned before it and never named by `latest`. Read-only tools pass False.
    """
    skipped = []
    for step in reversed(_published_steps(Path(root))):
        try:
            return LatestResult(open_checkpoint(root, step, verify=verify), skipped)
        except CheckpointError as e:
            skipped.append(str(e))
            if quarantine:
                path = Path(root) / f"step-{step}"
                try:
                    os.rename(path, path.with_name(f"step-{step}.refused-{int(time.time())}"))
                except OSError:
                    pass  # another rank moved it already
    return LatestResult(None, skipped)


def load_layers(ckpt: Checkpoint, modules: Mapping[int, nn.Module],
                optimizer: torch.optim.Optimizer | Mapping[int, torch.optim.Optimizer] | None) -> None:
    """Restore the layers this rank holds now (layer index -> module) from `ckpt`, with their
    optimizer state (`optimizer`: one for all, or one per layer)."""
    extra = [i for i in modules if not 0 <= i < ckpt.num_layers]
    if extra:
        raise CheckpointError(f"{ckpt.path}: has layers 0..{ckpt.num_layers - 1}; layers {extra} "
                              f"were asked for (a checkpoint of another model?)")
    for index, module in sorted(modules.items()):
        opt = optimizer.get(index) if isinstance(optimizer, Mapping) else optimizer
        load_layer_state(module, opt, ckpt.layer(index), layer=index)


def read_latest_pointer(root: str | Path) -> int | None:
    """The step named by `root/latest` (None if there is none)."""
    try:
        text = (Path(root) / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    m = _STEP_DIR.match(text)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- writing


@dataclass
class _Job:
    step: int
    shards: dict[int, dict[str, torch.Tensor]]
    train: tuple[dict[str, Any], dict[str, torch.Tensor]] | None
    tmp: Path


@dataclass
class SaveStats:
    step: int
    blocking_s: float
    """Time save() held the caller (snapshot to host memory)."""
    write_s: float = 0.0
    """Background time: files, fsyncs, record, publish."""
    bytes: int = 0
    published: bool = False
    """True when this rank's thread was the one that published the checkpoint."""


class Checkpointer:
    """One rank's checkpoint writer (see the module docstring).

        ckpt = Checkpointer(job.checkpoint, rank=rank, num_layers=model.num_layers)
        if ckpt.due(step):
            ckpt.save(step, {i: layer_state(mod[i], opt) for i in my_owned_layers},
                      train_state if rank == train_state_owner(plan) else None, tag=plan_tag(plan))
        ...
        ckpt.wait()   # before exit: the last save is durable (or its error is raised)
    """

    def __init__(self, root: str | Path | CheckpointConfig, *, rank: int, num_layers: int,
                 keep: int = 3, every_steps: int = 0, every_minutes: float = 0.0,
                 attempt: str | None = None):
        if not isinstance(root, (str, Path)):
            cfg = root
            if cfg.dir is None:
                raise CheckpointError("checkpoint.dir is not set; set it in the job file to enable "
                                      "checkpoints")
            root, keep, every_steps, every_minutes = cfg.dir, cfg.keep, cfg.every_steps, cfg.every_minutes
        if keep < 1:
            raise CheckpointError(f"keep={keep}: keep at least the latest checkpoint")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.num_layers = num_layers
        self.keep = keep
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.attempt = _safe(attempt if attempt is not None else default_attempt())
        self.history: list[SaveStats] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_step: int | None = None
        self._last_saved: tuple[int, str] | None = None
        self._last_time = time.monotonic()
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._snapshot_done: threading.Event | None = None
        self._stream: Any = None
        self.on_published: Callable[[SaveStats], None] | None = None
        """Called (on the writer thread) when this rank published a checkpoint."""

    # -- when
    def due(self, step: int, now: float | None = None) -> bool:
        """Whether the periodic rule asks for a checkpoint after `step` steps (see module doc
        about agreeing on the minutes rule across ranks)."""
        if step == self._last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes) and now - self._last_time >= 60.0 * self.every_minutes

    # -- save
    def save(self, step: int, shards: Mapping[int, Mapping[str, torch.Tensor]],
             train_state: TrainState | None = None, *, tag: str = "",
             defer_copy: bool = False) -> SaveStats | None:
        """Snapshot this rank's shards (layer -> layer_state) and, on the train-state owner, the
        training state to host memory, and write them in the background.

        Waits first for this rank's previous save (one in flight at a time; its error, if any, is
        raised here). Returns None if this Checkpointer already saved `step` with this `tag`. `tag`
        must be equal on every rank of the checkpoint (use `plan_tag(plan)`): after a
        reconfiguration, the same step can be saved again under the new plan's tag (e.g. when the
        first attempt lost a writer).

        `defer_copy`: return at once and take the snapshot in the background too, overlapped with
        the next step's forward and backward (which read but do not change the parameters and the
        optimizer state). The caller MUST call `fence()` before anything changes them (i.e. before
        the next `optimizer.step()` or a state transfer); only the wait in `fence()` pauses
        training. On a GPU the copy runs on its own CUDA stream, ordered after the work already
        queued on the current stream.
        """
        self.wait()
        if (step, tag) == self._last_saved:
            return None
        for key in [k for k in self._buffers if k[0] not in shards]:
            del self._buffers[key]  # a layer this rank no longer writes (the plan changed)
        for layer in shards:
            if not 0 <= layer < self.num_layers:
                raise CheckpointError(f"rank {self.rank}: layer {layer} is not a layer of this model "
                                      f"(0..{self.num_layers - 1})")
        t0 = time.perf_counter()
        train = None
        if train_state is not None:  # small: always copied now
            meta, tensors = _split_train_state(train_state)
            train = (meta, {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()})
        stats = SaveStats(step, 0.0)
        self._last_step, self._last_saved, self._last_time = step, (step, tag), time.monotonic()
        self.history.append(stats)
        if not shards and train is None:
            stats.blocking_s = time.perf_counter() - t0
            return stats  # this rank owns nothing in this checkpoint
        tmp = self.root / f"step-{step}.tmp.{self.attempt}.{_safe(tag)}"
        live = {int(i): dict(s) for i, s in shards.items()}
        stream = None
        if any(t.device.type == "cuda" for s in live.values() for t in s.values()):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            stream = self._stream
        job = _Job(step, {}, train, tmp)
        self._snapshot_done = None
        if defer_copy:
            self._snapshot_done = threading.Event()
        else:
            job.shards = self._snapshot(live, stream)
            live = None
        stats.blocking_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._run,
                                        args=(job, stats, live, stream, self._snapshot_done),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return stats

    def fence(self) -> None:
        """Wait until a `defer_copy` snapshot is taken (call before the state changes); no-op
        otherwise. The wait is added to the save's `blocking_s`."""
        done, self._snapshot_done = self._snapshot_done, None
        if done is not None:
            t0 = time.perf_counter()
            done.wait()
            if self.history:
                self.history[-1].blocking_s += time.perf_counter() - t0

    def _snapshot(self, shards: Mapping[int, Mapping[str, torch.Tensor]],
                  stream: Any = None) -> dict[int, dict[str, torch.Tensor]]:
        if stream is None:
            return {i: {k: self._host_copy((i, k), t) for k, t in s.items()} for i, s in shards.items()}
        with torch.cuda.stream(stream):
            snap = {i: {k: self._host_copy((i, k), t) for k, t in s.items()} for i, s in shards.items()}
        stream.synchronize()  # this stream only: training's own stream keeps running
        return snap

    def save_sync(self, step: int, shards: Mapping[int, Mapping[str, torch.Tensor]],
                  train_state: TrainState | None = None, *, tag: str = "") -> SaveStats | None:
        """save() and wait(): the checkpoint part of this rank is durable on return."""
        stats = self.save(step, shards, train_state, tag=tag)
        self.wait()
        return stats

    def wait(self) -> None:
        """Block until this rank's in-flight save is written; re-raise its error."""
        self.fence()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"rank {self.rank}: writing a checkpoint failed: {err}") from err

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, job: _Job, stats: SaveStats, live: dict | None, stream: Any,
             snapshot_done: threading.Event | None) -> None:
        t0 = time.perf_counter()
        try:
            if live is not None:  # defer_copy: the snapshot is taken here
                try:
                    job.shards = self._snapshot(live, stream)
                finally:
                    live = None
                    if snapshot_done is not None:
                        snapshot_done.set()
            stats.bytes, stats.published = self._write(job)
            stats.write_s = time.perf_counter() - t0
            if stats.published and self.on_published is not None:
                self.on_published(stats)
        except BaseException as e:  # reported by wait()
            if isinstance(e, FileNotFoundError) and (_published_steps(self.root) or [-1])[-1] > job.step:
                pass  # a newer checkpoint was published and removed this stale one: nothing lost
            else:
                self._error = e
        stats.write_s = time.perf_counter() - t0

    def _write(self, job: _Job) -> tuple[int, bool]:
        job.tmp.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        for layer, tensors in sorted(job.shards.items()):
            name = f"layer-{layer:05d}.bin"
            files[name] = {**_write_shard(job.tmp / name, tensors, {"layer": layer}), "layer": layer}
        if job.train is not None:
            meta, tensors = job.train
            files["train.bin"] = {**_write_shard(job.tmp / "train.bin", tensors, meta), "train": True}
        record = {"format": FORMAT_VERSION, "step": job.step, "rank": self.rank,
                  "num_layers": self.num_layers, "files": files, "host": socket.gethostname(),
                  "written_at": time.time()}
        _fsync_dir(job.tmp)
        _atomic_write(job.tmp / f"done-rank{self.rank:05d}.json", json.dumps(record).encode())
        published = try_publish(job.tmp, keep=self.keep)
        return sum(f["size"] for f in files.values()), published


    def _host_copy(self, key: tuple[int, str], t: torch.Tensor) -> torch.Tensor:
        """Copy `t` into this rank's host buffer for `key` (allocated on first use, pinned when
        CUDA is present, reused by later saves once the previous write is done: a copy into
        memory already mapped is several times faster than a fresh allocation)."""
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.device.type == "cuda")  # completed by _snapshot's sync
        return buf


def try_publish(tmp: Path, keep: int = 3) -> bool:
    """Publish `tmp` (a `step-<N>.tmp...` directory) if its completion records cover every layer and
    the training state. Safe to call by several writers at once and after a crash (e.g. on a
    directory whose writers all finished but died before publishing). Returns True if this call
    did the rename."""
    m = _TMP_DIR.match(tmp.name)
    if m is None:
        raise CheckpointError(f"{tmp}: not a step-<N>.tmp directory")
    step, root = int(m.group(1)), tmp.parent
    try:
        names = sorted(os.listdir(tmp))
    except FileNotFoundError:
        return False  # published (or removed) by someone else
    records = []
    for name in names:
        if name.startswith("done-rank") and name.endswith(".json"):
            try:
                records.append(json.loads((tmp / name).read_text()))
            except FileNotFoundError:
                return False
    if not records:
        return False
    num_layers = records[0]["num_layers"]
    layers: dict[str, str] = {}
    files: dict[str, dict[str, Any]] = {}
    train = None
    for rec in sorted(records, key=lambda r: r["rank"]):
        if rec["num_layers"] != num_layers or rec["step"] != step:
            raise CheckpointError(f"{tmp}: completion records disagree (rank {rec['rank']} wrote "
                                  f"step {rec['step']} of {rec['num_layers']} layers, rank "
                                  f"{records[0]['rank']} step {records[0]['step']} of {num_layers})")
        for name, f in rec["files"].items():
            if "layer" in f:
                layers.setdefault(str(f["layer"]), name)
            if f.get("train"):
                train = name
            files.setdefault(name, {"size": f["size"], "sha256": f["sha256"]})
    if train is None or len(layers) < num_layers:
        return False  # others are still writing
    manifest = {"format": FORMAT_VERSION, "step": step, "num_layers": num_layers,
                "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0]))),
                "train": train, "files": dict(sorted(files.items())),
                "writers": sorted(r["rank"] for r in records),
                "written_at": max(r["written_at"] for r in records)}
    final = root / f"step-{step}"
    try:
        _atomic_write(tmp / "MANIFEST.json", json.dumps(manifest, indent=1).encode())
    except FileNotFoundError:
        return False  # another publisher renamed the directory under us
    if final.exists():
        try:
            open_checkpoint(root, step, verify=False)
            shutil.rmtree(tmp, ignore_errors=True)  # an equal step is already published
            return False
        except CheckpointError:
            aside = root / f"step-{step}.bad-{int(time.time())}.deleting"
            os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except FileNotFoundError:
        return False  # the other publisher won
    _fsync_dir(root)
    _update_latest(root, step)
    prune(root, keep)
    return True


def _update_latest(root: Path, step: int) -> None:
    current = read_latest_pointer(root)
    if current is not None and current > step and (root / f"step-{current}").exists():
        return  # never move `latest` backwards
    _atomic_write(root / "latest", f"step-{step}\n".encode())


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` published checkpoints; drop older ones and stale temporary ones."""
    root = Path(root)
    steps = _published_steps(root)
    if not steps:
        return
    newest = steps[-1]
    doomed = [root / f"step-{s}" for s in steps[:-keep]]
    for name in os.listdir(root):
        m = _TMP_DIR.match(name)
        if m and int(m.group(1)) <= newest:
            doomed.append(root / name)
    for path in doomed:
        aside = path.with_name(f"{path.name}.{os.getpid()}.deleting")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    for name in os.listdir(root):
        if name.endswith(".deleting"):
            shutil.rmtree(root / name, ignore_errors=True)
        elif name.startswith(".latest.") and name.endswith(".tmp"):
            # A pointer update killed half-way; a live one renames its temp file within seconds.
            try:
                if time.time() - (root / name).stat().st_mtime > 60:
                    (root / name).unlink()
            except FileNotFoundError:
                pass


def wait_published(root: str | Path, step: int, timeout_s: float = 300.0, poll_s: float = 0.05) -> bool:
    """Wait until `step-<step>` is published under `root` (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if (Path(root) / f"step-{step}" / "MANIFEST.json").exists():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- fallback: requeue
#
# The training loop leaves through one door when it cannot go on in place:
#
#     stop = StopSignals.install()            # USR2 (pre-timeout), SIGTERM (preemption)
#     for step in ...:
#         try:
#             run_step(...)
#         except GuaranteeExceeded as e:       # raised by the elastic layer
#             sys.exit(checkpoint_and_requeue(str(e), ckpt, step, my_shards(), train_state(), ...))
#         if stop:                             # checked only at a step boundary
#             sys.exit(checkpoint_and_requeue(stop.reason, ckpt, step + 1, ...))
#
# The exit code EXIT_REQUEUE (75) tells the local launcher to start the job again; under Slurm the
# job's rank 0 also runs `scontrol requeue $SLURM_JOB_ID` once the checkpoint is published, so the
# job comes back with whatever nodes Slurm gives it and resumes from `find_latest`.


class StopSignals:
    """Signal handlers that only record the request; the loop acts at its next step boundary
    (a handler that saved or exited inside a collective would hang the other ranks).

    SIGUSR2: the pre-timeout warning (sbatch --signal=USR2@<s>, submitit's default).
    SIGTERM: preemption or scancel (Slurm sends SIGKILL KillWait seconds later, 30 s by default).
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return self.reason is not None

    @classmethod
    def install(cls, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> StopSignals:
        """Install the handlers (from the main thread) and return the flag object."""
        stop = cls()
        for signum in signals:
            stop._previous[signum] = signal.signal(signum, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.reason is None:
            self.signum = signum
            self.reason = f"received {signal.Signals(signum).name}"

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def request_slurm_requeue(env: Mapping[str, str] | None = None, run: Any = subprocess.run) -> bool:
    """`scontrol requeue $SLURM_JOB_ID` when running under Slurm; False when not under Slurm.
    Raises CheckpointError with scontrol's message if Slurm refuses (e.g. the job was not submitted
    with --requeue and the cluster's JobRequeue=0)."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if not job_id:
        return False
    out = run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if out.returncode != 0:
        raise CheckpointError(f"scontrol requeue {job_id} failed (exit {out.returncode}): "
                              f"{(out.stderr or out.stdout).strip()}; submit with --requeue")
    return True


def checkpoint_and_requeue(reason: str, checkpointer: Checkpointer | None = None,
                           step: int | None = None,
                           shards: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
                           train_state: TrainState | None = None, *, tag: str = "",
                           requeue_rank: bool = False, publish_timeout_s: float = 120.0,
                           env: Mapping[str, str] | None = None, run: Any = subprocess.run,
                           log: Any = None) -> int:
    """Leave training so that the job comes back and resumes: returns EXIT_REQUEUE for sys.exit.

    - With `step` and `shards` (this rank's part; the train state on its owner): save a checkpoint
      of `step` synchronously. Without them (a rank whose state is gone, or no time to save): only
      finish this rank's in-flight save; the job resumes from the latest published checkpoint.
    - On the one rank with `requeue_rank` (the job's rank 0): wait until the checkpoint of `step`
      is published (all ranks' shards durable), then under Slurm `scontrol requeue`. Locally the
      launcher sees exit code 75 and starts the job again.
    """
    log = log or (lambda msg: print(f"[checkpoint] {msg}", file=sys.stderr, flush=True))
    log(f"stopping for requeue: {reason}")
    if checkpointer is not None:
        try:
            if step is not None and shards is not None:
                checkpointer.save_sync(step, shards, train_state, tag=tag)
            else:
                checkpointer.wait()
        except CheckpointError as e:
            log(f"the checkpoint failed ({e}); the job will resume from the latest good one")
        if requeue_rank and step is not None and shards is not None:
            if not wait_published(checkpointer.root, step, publish_timeout_s):
                log(f"checkpoint of step {step} not published after {publish_timeout_s:.0f} s; "
                    f"the job will resume from the latest good one")
    if requeue_rank:
        try:
            if request_slurm_requeue(env, run):
                log("asked Slurm to requeue the job")
        except CheckpointError as e:
            log(str(e))
    return EXIT_REQUEUE
