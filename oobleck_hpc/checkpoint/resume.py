"""Checkpoints in the training loop: restore at start, save after committed steps, leave for a requeue.

The training loop (train.py) calls this module at three places, and nowhere else:

    ckpt = Resume.start(job, plan, rank, comm, device, run_dir, profile)   # before the Engine
    engine = Engine(..., state=ckpt.state, layer_states=ckpt.layer_states)
    while engine.state.step < job.train.steps:
        ... a committed step (in place recovery happens in between) ...
        if (code := ckpt.after_step(engine)) is not None:
            return code                                    # 75: checkpoint on disk, requeue me
    # recovery raised errors.GuaranteeExceeded:
        return ckpt.fallback(str(e))                       # 75: resume from the latest one
    ckpt.finish()                                          # the last save is durable

Restore (`Resume.start`)
------------------------
Rank 0 finds the newest checkpoint under `checkpoint.dir` that verifies (`find_latest`: full
sha256 check, partial or corrupt ones quarantined) and the ranks agree on its step with one
all-reduce (MAX; the others contribute -1), so every rank restores the SAME step. Each rank then
reads only the layers its stage of THIS run's plan holds (`Checkpoint.layer`, checksum verified
while reading) -- a checkpoint is sharded by layer, not by rank, so it restores onto any plan and
node count -- and the training state: step and sample cursor. The global sampler (engine/
sampler.py) is a pure function of the cursor and the LR a pure function of the step, so the
resumed run computes exactly the global batches and updates an uninterrupted run would have.
No checkpoint (or no `checkpoint.dir`): a fresh start.

Periodic save (`Resume.after_step`)
-----------------------------------
After each committed step, each rank snapshots the layers that `shard_owners(plan)` assigns to it
(one writer per layer among its replicas, balanced over nodes by bytes) and rank 0 the training
state, through one `Checkpointer` (asynchronous, atomic: checkpoint/). The snapshot is taken
with `defer_copy=True`: the copy to host memory runs in the background during the next step's
forward and backward, which only read the weights and the optimizer state, and a hook on the
engine's "optimizer" phase calls `fence()` before `optimizer.step()` changes them (training
pauses only for whatever copy is left at that point).

All ranks must save the same steps. `every_steps` is the same rule everywhere; `every_minutes`
reads each rank's clock, and a stop signal may reach the ranks at different moments, so each
rank puts [save due, stop requested] on its ballot in the step's commit vote (`ballot`;
recovery/driver.py) and the vote's maximum makes the decision common -- no collective of its own,
so nothing here can block on a dead peer. The last step is not saved periodically (the run is
over; a stop signal still saves).

Leaving (`after_step` on a stop signal, `fallback` on GuaranteeExceeded)
------------------------------------------------------------------------
`StopSignals` records SIGUSR2 (Slurm's pre-timeout warning) and SIGTERM (preemption, scancel) and
the loop acts at its next step boundary: every rank saves the current step synchronously (its
shards durable before it returns), rank 0 waits until the checkpoint is published, and all
return errors.EXIT_REQUEUE (75). The launcher requeues: locally launch/requeue.py starts the job
again, under Slurm the launch driver (launch/slurm_driver.py, or slurm_task when the batch node
is gone) runs `scontrol requeue` on the agents' 75 -- the workers never call scontrol
themselves, so a job is requeued once.

When the guarantee is exceeded (a layer lost on every pipeline, fewer than n0 nodes) the
survivors cannot write a complete checkpoint: they finish their in-flight save and leave with 75;
the job resumes from the latest published checkpoint, losing at most one checkpoint interval.
Rank 0 also writes RUN_DIR/requeue.json (reason, step, the nodes still alive) so that the local
requeue role restarts the job on the nodes it has.

Watchdog: rank 0 beats RUN_DIR/heartbeat (operate/liveness.py) at most once a second and at
the end.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oobleck_hpc.records import runs
from oobleck_hpc.records import events as ev
from oobleck_hpc.errors import EXIT_REQUEUE, GuaranteeExceeded
from oobleck_hpc.files import write_json

if TYPE_CHECKING:
    import torch

    from oobleck_hpc.checkpoint import Checkpointer, StopSignals
    from oobleck_hpc.config import JobConfig
    from oobleck_hpc.engine import Engine, TrainState
    from oobleck_hpc.planning.plan import Plan
    from oobleck_hpc.profiling.profile import ModelProfile

BEAT_EVERY_S = 1.0
logger = logging.getLogger(__name__)
"""What went wrong on the way (a refused checkpoint, a failed save or write): warnings."""
_log = functools.partial(runs.say, "resume")
"""The rank's account of a restore or a requeue (restored step N, stopping at step N, the
step the requeued job resumes from): a worker's log says it at any log level."""


@dataclass
class Resume:
    """One rank's checkpoint role in training (see the module docstring)."""

    job: JobConfig
    rank: int
    run_dir: Path
    device: Any
    checkpointer: Checkpointer | None
    stop: StopSignals
    profile: ModelProfile | None = None
    state: TrainState | None = None
    """Where the restored run stands (None: a fresh start)."""
    layer_states: dict[int, dict[str, torch.Tensor]] | None = None
    """This rank's layers from the checkpoint (None: build them fresh)."""
    _owners: tuple[str, dict[int, int]] | None = None
    _hooked: Any = None
    _last_beat: float = 0.0
    faults: Any = None
    events: Any = None
    """The run's EventLog: restored, checkpoint_saved, stopping, fallback (what the console
    and `oobleck-hpc report` tell)."""
    log: Any = field(default=_log, repr=False)

    # ------------------------------------------------------------------ start

    @classmethod
    def start(cls, job: JobConfig, plan: Plan, rank: int, comm: Any, device: Any,
              run_dir: str | Path, profile: ModelProfile | None = None,
              faults: Any = None, events: Any = None,
              abort: Callable[[], bool] | None = None, restore: bool = True) -> Resume:
        """Install the stop-signal handlers, open the checkpoint directory and restore from the
        latest good checkpoint onto `plan` (every rank of the world must call this). A peer
        lost during the restore raises RuntimeError (train.py rendezvous again and retries) --
        at once when `abort` (the driver's `round_opened`) turns true, else at the regroup's
        timeout. `faults`: the worker's fault injector (its `checkpoint` window fires in a
        save). `restore=False`: a spare swapped into a running job, whose state came from the
        members (driver.join), only takes its part in the saves."""
        from oobleck_hpc.checkpoint import Checkpointer, StopSignals

        stop = StopSignals.install()
        cp = None
        if job.checkpoint.dir is not None:
            cp = Checkpointer(job.checkpoint, rank=rank, num_layers=plan.num_layers)
        self = cls(job, rank, Path(run_dir), device, cp, stop, profile, faults=faults,
                   events=events)
        if cp is not None and events is not None:
            cp.on_published = lambda stats: _published(events, cp.root, stats)
        if cp is not None and restore:
            try:
                self._restore(plan, comm, abort)
            except BaseException:
                stop.uninstall()
                raise
        return self

    @classmethod
    def unstarted(cls, job: JobConfig, run_dir: str | Path, device: Any,
                  events: Any = None) -> Resume:
        """For a fallback before `start` completed (a run that lost too many nodes while
        starting): nothing restored or saved by this run, the checkpoint directory untouched."""
        from oobleck_hpc.checkpoint import StopSignals

        return cls(job, 0, Path(run_dir), device, None, StopSignals(), events=events)

    def _restore(self, plan: Plan, comm: Any, abort: Callable[[], bool] | None) -> None:
        from oobleck_hpc.checkpoint import CheckpointError, find_latest, open_checkpoint
        from oobleck_hpc.engine import TrainState

        assert self.checkpointer is not None
        root = self.checkpointer.root
        step = -1
        if self.rank == 0:
            found = find_latest(root)
            for why in found.skipped:
                logger.warning("refused a checkpoint: %s", why)
            if found.checkpoint is not None:
                step = found.checkpoint.step
        # Rank 0 may take long verifying a large checkpoint: the regroup's timeout bounds it.
        step = int(comm.all_reduce_max([step], abort, comm.setup_timeout_s)[0])
        if step < 0:
            if self.rank == 0:
                self.log(f"no checkpoint under {root}: starting from step 0")
            return
        t0 = time.perf_counter()
        ckpt = open_checkpoint(root, step, verify=False)  # rank 0 verified every file
        if ckpt.num_layers != plan.num_layers:
            raise CheckpointError(f"{ckpt.path} holds {ckpt.num_layers} layers but the job's model "
                                  f"has {plan.num_layers}: a checkpoint of another model; point "
                                  f"checkpoint.dir elsewhere or remove it")
        info = plan.ranks[self.rank]
        self.layer_states = {i: {k: v.clone() for k, v in ckpt.layer(i).items()}
                             for i in range(info.layer_start, info.layer_end)}
        ts = ckpt.train_state()
        if ts.step != step:
            raise CheckpointError(f"{ckpt.path}: train state says step {ts.step}, directory {step}")
        self.state = TrainState(step=ts.step, cursor=ts.samples_seen)
        if self.rank == 0:
            seconds = time.perf_counter() - t0
            self.log(f"restored step {step} (cursor {ts.samples_seen}) from {ckpt.path} onto plan "
                     f"{plan.digest()} ({len(plan.nodes)} nodes) in {seconds:.2f} s; written by "
                     f"plan {ts.plan_digest}")
            if self.events is not None:
                self.events.emit(ev.RESTORED, step=step, path=str(ckpt.path),
                                 seconds=round(seconds, 3), plan=plan.digest(),
                                 written_by=ts.plan_digest)

    # ------------------------------------------------------------------ each step

    def ballot(self, engine: Engine) -> list[float]:
        """This rank's say in the next step's commit vote (recovery/driver.py): [a save due by
        the clock after that step, a stop signal seen]. The vote's elementwise max makes both
        decisions common to every rank at no cost of its own."""
        return [float(self._clock_due(engine.state.step + 1)), float(bool(self.stop))]

    def _clock_due(self, step: int) -> bool:
        """A save after `step` steps that only the clock (`every_minutes`) asks for: ranks
        must agree on it; `every_steps` is the same rule everywhere."""
        cp = self.checkpointer
        return (cp is not None and cp.due(step)
                and not (cp.every_steps and step % cp.every_steps == 0))

    def after_step(self, engine: Engine, agreed: list[float] | None = None) -> int | None:
        """Call after every committed step with the vote's agreed ballot (`ballot`). Saves when
        due, beats the watchdog's heartbeat, and returns EXIT_REQUEUE when the job must leave
        (a stop signal: checkpoint written), else None. Without `agreed` (a one-rank world
        that did not vote) the rank's own clock and signals decide."""
        step = engine.state.step
        self.rank = engine.comm.rank  # a reconfiguration may have renumbered the ranks
        if self.rank == 0:
            self._beat(step, final=step >= self.job.train.steps)
        cp = self.checkpointer
        due = cp is not None and bool(cp.every_steps) and step % cp.every_steps == 0
        if agreed is None:
            clock_due, stop = self._clock_due(step), bool(self.stop)
        else:
            clock_due, stop = bool(agreed[0]), bool(agreed[1])
        if stop:
            reason = self.stop.reason or "a peer received a stop signal"
            return self.leave(reason, engine)
        if cp is not None and (due or clock_due) and step < self.job.train.steps:
            self._save(engine, sync=False)
        return None

    def _save(self, engine: Engine, sync: bool) -> None:
        from oobleck_hpc.checkpoint import CheckpointError, TrainState, plan_tag, shard_owners

        cp = self.checkpointer
        assert cp is not None
        plan = engine.plan
        if self._owners is None or self._owners[0] != plan.digest():
            self._owners = (plan.digest(), shard_owners(plan, self.profile))
        mine = [layer for layer, r in self._owners[1].items() if r == engine.comm.rank]
        shards = {layer: engine.layer_state(layer) for layer in mine}
        train = None
        if engine.comm.rank == 0:
            train = TrainState(step=engine.state.step, samples_seen=engine.state.cursor,
                               plan=plan.to_dict(), plan_digest=plan.digest(),
                               generation=plan.generation,
                               extra={"global_batch": self.job.train.microbatch_size
                                      * self.job.train.global_microbatches,
                                      "nodes": list(plan.nodes)})
        try:
            if sync:
                cp.save_sync(engine.state.step, shards, train, tag=plan_tag(plan),
                             rank=engine.comm.rank)
            else:
                cp.save(engine.state.step, shards, train, tag=plan_tag(plan), defer_copy=True,
                        rank=engine.comm.rank)
                self._hook_fence(engine)
                if self.faults is not None:
                    self.faults("checkpoint", engine.state.step)
        except CheckpointError as e:
            # A failed save never stops training: the previous checkpoint stays the latest.
            logger.warning("rank %d: checkpoint of step %d failed: %s", self.rank,
                           engine.state.step, e)

    def _hook_fence(self, engine: Engine) -> None:
        """Make the engine call fence() before its optimizer changes the state (once per engine;
        a reconfiguration builds a new engine and the next save hooks that one)."""
        if self._hooked is engine:
            return
        inner = engine.on_phase
        cp = self.checkpointer

        def on_phase(phase: str, step: int) -> None:
            if phase == "optimizer" and cp is not None:
                cp.fence()
            if inner is not None:
                inner(phase, step)

        engine.on_phase = on_phase
        self._hooked = engine

    def _beat(self, step: int, final: bool = False) -> None:
        from oobleck_hpc.operate.liveness import beat

        now = time.monotonic()
        if final or now - self._last_beat >= BEAT_EVERY_S:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                beat(self.run_dir, step)
            except OSError as e:
                logger.warning("cannot write the heartbeat in %s: %s", self.run_dir, e)
            self._last_beat = now

    # ------------------------------------------------------------------ leaving

    def leave(self, reason: str, engine: Engine, nodes: list[str] | None = None) -> int:
        """Every rank: save the current (committed) step synchronously; rank 0 waits for the
        publish and records `nodes` (default: the plan's) for the local requeue. Returns
        EXIT_REQUEUE. Every rank must call it after the same step (a decision of the vote)."""
        from oobleck_hpc.checkpoint import wait_published

        self.log(f"rank {self.rank}: stopping at step {engine.state.step} for a requeue: {reason}")
        if self.rank == 0 and self.events is not None:
            self.events.emit(ev.STOPPING, step=engine.state.step, reason=reason)
        if self.checkpointer is None:
            logger.warning("checkpoint.dir is not set: nothing saved; the requeued job starts over")
        else:
            self._save(engine, sync=True)
            if self.rank == 0 and not wait_published(self.checkpointer.root, engine.state.step, 120):
                logger.warning("the checkpoint of step %d was not published within 120 s; the job "
                               "resumes from the latest published one", engine.state.step)
        if self.rank == 0:
            self._write_requeue_record(reason, engine.state.step,
                                       list(engine.plan.nodes) if nodes is None else nodes)
        self.stop.uninstall()
        return EXIT_REQUEUE

    def fallback(self, reason: str | BaseException, nodes: list[str] | None = None) -> int:
        """The guarantee is exceeded: no complete state is left to save. Finish this rank's
        in-flight save and return EXIT_REQUEUE; the job resumes from the latest published
        checkpoint. Rank 0 records `nodes` (the nodes still alive, if known; a GuaranteeExceeded
        raised by a recovery knows them) for the local requeue."""
        if nodes is None and isinstance(reason, GuaranteeExceeded) and reason.survivors:
            nodes = list(reason.survivors)
        reason = str(reason)
        self.log(f"rank {self.rank}: guarantee exceeded, falling back to the latest checkpoint: "
                 f"{reason}")
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            except Exception as e:
                logger.warning("rank %d: the in-flight checkpoint failed (%s)", self.rank, e)
        if self.rank == 0:
            from oobleck_hpc.checkpoint import read_latest_pointer

            latest = read_latest_pointer(self.checkpointer.root) if self.checkpointer else None
            self.log(f"the requeued job resumes from step {latest if latest is not None else 0}")
            self._write_requeue_record(reason, latest, nodes)
        if self.events is not None:  # every rank: rank 0 may be the one that is gone
            from oobleck_hpc.checkpoint import read_latest_pointer

            root = self.job.checkpoint.dir
            self.events.emit(ev.FALLBACK, reason=reason[:300], nodes=nodes,
                             resume_from=read_latest_pointer(root) if root else None)
        self.stop.uninstall()
        return EXIT_REQUEUE

    def _write_requeue_record(self, reason: str, step: int | None, nodes: list[str] | None) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json(self.run_dir / runs.REQUEUE_RECORD,
                       {"reason": reason, "step": step, "nodes": nodes,
                        "restart_count": runs.attempt(), "time": time.time()},
                       durable=True, indent=None)
        except OSError as e:
            logger.warning("cannot write %s: %s", self.run_dir / runs.REQUEUE_RECORD, e)

    def fence(self) -> None:
        """Wait until an in-flight snapshot is taken: call before anything but the engine's own
        optimizer step changes weights or optimizer state in place (e.g. loading transferred
        state into the same modules)."""
        if self.checkpointer is not None:
            self.checkpointer.fence()

    def finish(self, engine: Engine | None = None) -> None:
        """The run is over: beat the final step and make the last save durable."""
        if engine is not None and self.rank == 0:
            self._beat(engine.state.step, final=True)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.stop.uninstall()


def _published(events: Any, root: Path, stats: Any) -> None:
    """The `checkpoint_saved` event of a checkpoint this rank published (its whole size)."""
    path = root / f"step-{stats.step}"
    try:
        size = sum(f.stat().st_size for f in path.iterdir())
    except OSError:  # pruned meanwhile by a newer one
        size = stats.bytes
    events.emit(ev.CHECKPOINT_SAVED, step=stats.step, bytes=size, seconds=round(stats.write_s, 3),
                path=str(path))
