"""The checkpoint directory: publishing, the `latest` pointer, pruning, and finding and opening a
published checkpoint.

    step-<N>.tmp.<attempt>.<tag>/   being written (shards + one completion record per writer)
    step-<N>/                       published: the same files + MANIFEST.json
    latest                          "step-<N>": the newest published checkpoint

`try_publish` turns a complete `step-<N>.tmp...` directory into `step-<N>` (any writer may, any
number at once); `prune` keeps the newest `keep`; `find_latest` / `open_checkpoint` return a
`Checkpoint` whose files match its manifest; `load_layers` restores modules from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oobleck_hpc.checkpoint.shards import FORMAT_VERSION, build_manifest, read_shard
from oobleck_hpc.checkpoint.state import (
    LayerState,
    TrainState,
    join_train_state,
    load_layer_state,
)
from oobleck_hpc.errors import CheckpointError
from oobleck_hpc.files import fsync_dir, write_atomic
from oobleck_hpc.polling import wait_until

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp\.")


def published_steps(root: Path) -> list[int]:
    """The steps of the published checkpoints under `root`, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


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
        _, tensors = read_shard(self.path / name, self.manifest["files"][name])
        return tensors

    def train_state(self) -> TrainState:
        name = self.manifest["train"]
        meta, tensors = read_shard(self.path / name, self.manifest["files"][name])
        return join_train_state(meta, tensors)


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
    for step in reversed(published_steps(Path(root))):
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


# ----------------------------------------------------------------------------- publishing


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
    manifest = build_manifest(tmp, step, records)
    if manifest is None:
        return False  # others are still writing
    final = root / f"step-{step}"
    try:
        write_atomic(tmp / "MANIFEST.json", json.dumps(manifest, indent=1), durable=True)
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
    fsync_dir(root)
    _update_latest(root, step)
    prune(root, keep)
    return True


def _update_latest(root: Path, step: int) -> None:
    current = read_latest_pointer(root)
    if current is not None and current > step and (root / f"step-{current}").exists():
        return  # never move `latest` backwards
    write_atomic(root / "latest", f"step-{step}\n", durable=True)


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` published checkpoints; drop older ones and stale temporary ones."""
    root = Path(root)
    steps = published_steps(root)
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
    manifest = Path(root) / f"step-{step}" / "MANIFEST.json"
    try:
        return wait_until(manifest.exists, timeout_s, str(manifest), every_s=poll_s)
    except TimeoutError:
        return False
