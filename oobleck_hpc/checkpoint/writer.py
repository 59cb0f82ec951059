"""One rank's asynchronous checkpoint writer: `Checkpointer` (see the package docstring).

`save` snapshots this rank's shards into reused host buffers (pinned on a GPU, copied on a CUDA
stream of its own) and a background thread writes the shard files, the completion record and,
when this rank's record completes the checkpoint, publishes it (`directory.try_publish`).
`due` is the periodic rule (steps and/or minutes).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oobleck_hpc.checkpoint.directory import published_steps, try_publish
from oobleck_hpc.checkpoint.shards import completion_record, write_shard
from oobleck_hpc.checkpoint.state import TrainState, split_train_state
from oobleck_hpc.errors import CheckpointError
from oobleck_hpc.files import fsync_dir, write_atomic

if TYPE_CHECKING:
    from oobleck_hpc.config import CheckpointConfig


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


@dataclass
class _Job:
    step: int
    shards: dict[int, dict[str, torch.Tensor]]
    train: tuple[dict[str, Any], dict[str, torch.Tensor]] | None
    tmp: Path
    rank: int
    """The writer's rank in the plan the save's tag names: its record's name."""


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
    """One rank's checkpoint writer (see the package docstring, oobleck_hpc.checkpoint).

        ckpt = Checkpointer(job.checkpoint, rank=rank, num_layers=model.num_layers)
        if ckpt.due(step):
            ckpt.save(step, {i: layer_state(mod[i], opt) for i in my_owned_layers},
                      train_state if rank == train_state_owner(plan) else None, tag=plan_tag(plan),
                      rank=rank)  # (this rank in `plan`: it changes when the plan does)
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
        """Whether the periodic rule asks for a checkpoint after `step` steps (see the package
        docstring about agreeing on the minutes rule across ranks)."""
        if step == self._last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes) and now - self._last_time >= 60.0 * self.every_minutes

    # -- save
    def save(self, step: int, shards: Mapping[int, Mapping[str, torch.Tensor]],
             train_state: TrainState | None = None, *, tag: str = "",
             defer_copy: bool = False, rank: int | None = None) -> SaveStats | None:
        """Snapshot this rank's shards (layer -> layer_state) and, on the train-state owner, the
        training state to host memory, and write them in the background.

        Waits first for this rank's previous save (one in flight at a time; its error, if any, is
        raised here). Returns None if this Checkpointer already saved `step` with this `tag`. `tag`
        must be equal on every rank of the checkpoint (use `plan_tag(plan)`): after a
        reconfiguration, the same step can be saved again under the new plan's tag (e.g. when the
        first attempt lost a writer).

        `rank`: this writer's rank in the plan `tag` names (default: the rank it was built with),
        which names its completion record. It must differ between the writers of one checkpoint:
        a process's rank changes when the job reconfigures, and a node that joins can take the
        rank another writer was built with (the joiner's record then replaced the other's, and
        no checkpoint was published again).

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
            meta, tensors = split_train_state(train_state)
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
        job = _Job(step, {}, train, tmp, self.rank if rank is None else rank)
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
                  train_state: TrainState | None = None, *, tag: str = "",
                  rank: int | None = None) -> SaveStats | None:
        """save() and wait(): the checkpoint part of this rank is durable on return."""
        stats = self.save(step, shards, train_state, tag=tag, rank=rank)
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
        except FileNotFoundError as e:
            # Nothing lost if this step was published (another writer renamed the directory once
            # this rank's record was in, between its rename and the fsync of the directory that
            # held it), or a newer one and this stale one removed.
            if (published_steps(self.root) or [-1])[-1] < job.step:
                self._error = e
        except BaseException as e:  # reported by wait()
            self._error = e
        stats.write_s = time.perf_counter() - t0

    def _write(self, job: _Job) -> tuple[int, bool]:
        job.tmp.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        for layer, tensors in sorted(job.shards.items()):
            name = f"layer-{layer:05d}.bin"
            files[name] = {**write_shard(job.tmp / name, tensors, {"layer": layer}), "layer": layer}
        if job.train is not None:
            meta, tensors = job.train
            files["train.bin"] = {**write_shard(job.tmp / "train.bin", tensors, meta), "train": True}
        record = completion_record(job.step, job.rank, self.num_layers, files,
                                   socket.gethostname(), time.time())
        fsync_dir(job.tmp)
        write_atomic(job.tmp / f"done-rank{job.rank:05d}.json", json.dumps(record), durable=True)
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
