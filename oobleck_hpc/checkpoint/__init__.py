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
        done-rank<r>.json            files, sizes, sha256 of what rank r of <tag>'s plan wrote
                                     (atomic, fsynced)
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

Leaving for a requeue (checkpoint/resume.py): `StopSignals.install()` makes SIGUSR2 (before the time limit)
and SIGTERM (preemption) set a flag read at step boundaries; on it every rank saves the current
step synchronously, rank 0 waits until the checkpoint is published, and all return
errors.EXIT_REQUEUE (75). On GuaranteeExceeded no complete state is left to save: the ranks only
finish their in-flight save and return 75, and the job resumes from the latest published
checkpoint. The launcher, never a worker, requeues the job (launch/).

Periodic saving (`Checkpointer.due`) is by steps and/or minutes (`CheckpointConfig`). All ranks
must save the same steps: the step rule is identical everywhere; the minutes rule reads a local
clock, so with several ranks the caller must agree on it before calling `save` (checkpoint/resume.py puts
each rank's `due` on the step's commit vote and acts on the vote's maximum).

Modules
-------
    ownership.py   shard_owners, train_state_owner, plan_tag (who writes what; no torch)
    state.py       layer_state / load_layer_state, TrainState, capture_rng / restore_rng
    shards.py      the shard file format, completion records and the manifest
    writer.py      Checkpointer (the asynchronous writer), SaveStats, default_attempt
    directory.py   try_publish, `latest`, prune, wait_published, open_checkpoint, find_latest,
                   load_layers
    signals.py     StopSignals

Their public names (`__all__` below) are importable from `oobleck_hpc.checkpoint`.
"""

from __future__ import annotations

from oobleck_hpc.checkpoint.directory import (
    Checkpoint,
    LatestResult,
    find_latest,
    load_layers,
    open_checkpoint,
    prune,
    read_latest_pointer,
    try_publish,
    wait_published,
)
from oobleck_hpc.checkpoint.ownership import plan_tag, shard_owners, train_state_owner
from oobleck_hpc.checkpoint.shards import FORMAT_VERSION
from oobleck_hpc.checkpoint.signals import StopSignals
from oobleck_hpc.checkpoint.state import (
    LayerState,
    TrainState,
    capture_rng,
    layer_state,
    load_layer_state,
    restore_rng,
)
from oobleck_hpc.checkpoint.writer import Checkpointer, SaveStats, default_attempt
from oobleck_hpc.errors import CheckpointError

__all__ = [
    "FORMAT_VERSION", "Checkpoint", "CheckpointError", "Checkpointer", "LatestResult",
    "LayerState", "SaveStats", "StopSignals", "TrainState", "capture_rng", "default_attempt",
    "find_latest", "layer_state", "load_layer_state", "load_layers", "open_checkpoint",
    "plan_tag", "prune", "read_latest_pointer", "restore_rng", "shard_owners",
    "train_state_owner", "try_publish", "wait_published",
]
