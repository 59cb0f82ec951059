"""One rank's part of a plan: its stage, its 1F1B action list, per-layer gradient sync, AdamW.

Build (once per plan; what the rank holds: engine/stage.py): the rank builds only its layers
[layer_start, layer_end), deterministic from (seed, layer) or read from the job's pretrained
`model.weights` (models/hf_weights.py), so replicas start bit-identical without a broadcast. A
layer whose state comes from elsewhere is never initialised: `adopt` (a reconfiguration's kept
layers) hands over another engine's modules and AdamW state as they are -- the same tensors,
nothing copied; a layer in `layer_states` (a checkpoint) or in `receive` (state that a transfer
will write) is allocated uninitialised (`model.empty_layer`), so building an engine costs the
same however many layers it receives. A layer's state has one format everywhere
(`checkpoint.layer_state`: param/, buffer/, optim/ tensors). Receive buffers are preallocated
from `model.layer_output_shape`: no shapes travel at run time. The step's compute time
(`StepResult.compute_s`) is measured by engine/clock.py.

Step (`Engine.step()`), for the global batch at `state.cursor`:

1. Pipeline: the rank runs its action list (engine/schedule.py). F(k) computes its rows of
   microbatch k; the last stage turns logits into per-sample losses and backpropagates
       L_rank = (sum of its per-sample losses) / B          (B = samples in the global batch)
   Summing the gradients of L_rank over every holder of a layer gives exactly the gradient of
   the mean loss over the global batch, whatever the plan.
2. Gradient sync: a stage's layers are grouped into segments of consecutive layers with the
   same holder set (`plan.layer_owners`); a segment's gradients live in one flat buffer (the
   parameters' `.grad` are views of it, as DDP's gradient_as_bucket_view) and are all-reduced
   (SUM) with one collective over that rank set. Backward runs segment by segment; during the
   last microbatch's backward a segment's all-reduce starts as soon as its gradients are final,
   overlapping the backward of the segments before it and the cool-down of earlier stages.
   A tensor two layers share (tied embeddings) then gets both copies' gradients summed over
   the holders of both layers (engine/tied.py).
3. Global statistics: one all-reduce over the world of [loss sum, sum of ||g_l||^2 over the
   segments this rank is the lowest holder of] -- every layer, and a shared tensor, counted
   exactly once.
   With `train.recompute` each layer keeps only its input and recomputes its forward in the
   backward pass (`Segment.recompute`).
4. Clip with the global norm, set the LR of this step, AdamW. Only then the state (step,
   cursor) advances: the step is committed. `step(commit=False)` stops before the update with
   the step *prepared* (reduced, clipped gradients in place) and leaves `commit()` /
   `rollback()` to the caller: the elastic layer commits only after every member voted that it
   holds the prepared step (recovery/driver.py), so no rank applies a step another rank may
   lack. `commit()` is local (no peer involved).

Failures are values: any exception in 1-3 (a peer died, a collective timed out) is caught and
returned as `StepResult(ok=False, error, phase, peer)`; weights, optimizer state and training
state are untouched (the optimizer has not run), so the step can be replayed on a new plan.
The engine never exits and never decides what to do about a failure.

`abort()` (optional) is polled while the rank waits for communication (the final all-reduce
included): when it turns true the wait is given up and the step returns as failed (error
`Aborted`); the elastic layer sets it when its agents opened a membership round, so that no
survivor waits out the collective timeout on a peer that already left the step. While it waits,
`waiting` says since when, in which phase and on which ranks (`Waiting`): the elastic layer's
stall watch reads it from another thread to report a peer that never arrives (a hung node) long
before any timeout.

`on_phase(phase, step)` (optional) is called when the step enters forward, backward,
gradient_sync, reduce (the final all-reduce posted, not yet complete), optimizer (in `commit()`,
before the update) and commit (after the update, before the state advances): the elastic layer
injects faults there. What it raises is not a communication failure and propagates out of
`step()` / `commit()` unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from oobleck_hpc.checkpoint import layer_state, load_layer_state
from oobleck_hpc.config import JobConfig
from oobleck_hpc.engine.clock import ComputeClock
from oobleck_hpc.engine.groups import Comm, PlanGroups, Waiter
from oobleck_hpc.engine.optim import clip_coefficient, lr_at, make_optimizer, set_lr
from oobleck_hpc.engine.sampler import Dataset, GlobalSampler
from oobleck_hpc.engine.schedule import Action, max_in_flight, pipeline_schedule, validate
from oobleck_hpc.engine.stage import build_layers, make_segments, transfer_buffers
from oobleck_hpc.engine.state import StepResult, TrainState, Waiting
from oobleck_hpc.engine.tied import TiedGradients
from oobleck_hpc.models.base import LayerModel
from oobleck_hpc.planning.plan import Plan

PHASES = ("forward", "backward", "gradient_sync", "reduce", "optimizer", "commit")


@dataclass
class _Failure(Exception):
    phase: str
    peer: int | None
    group: tuple[int, ...] | None
    cause: BaseException


class Engine:
    """One rank's share of `plan` in the world `comm` (rank = comm.rank).

    groups: the plan's groups (`PlanGroups.build(plan, comm)`); dataset: any object with
    `__len__` and `sample(i) -> (x, y)`; state: where training stands (default: step 0, cursor
    0); on_phase: fault-injection hook (see module docstring). Where each owned layer comes
    from (module docstring): `adopt`, an engine whose modules and AdamW state this one takes
    over for the layers both hold (the other engine must not step again: it may only be read,
    e.g. as the source of a transfer, and closed); `layer_states`, per layer a `layer_state()`
    dict to load (a checkpoint); `receive`, layers a transfer will fill; else built fresh from
    (seed, index).
    """

    def __init__(self, job: JobConfig, model: LayerModel, plan: Plan, comm: Comm,
                 groups: PlanGroups, dataset: Dataset, device: torch.device | str = "cpu",
                 state: TrainState | None = None,
                 layer_states: dict[int, dict[str, torch.Tensor]] | None = None,
                 on_phase: Callable[[str, int], None] | None = None,
                 abort: Callable[[], bool] | None = None, *,
                 adopt: Engine | None = None, receive: Collection[int] = ()):
        self.job, self.model, self.plan, self.comm, self.groups = job, model, plan, comm, groups
        self.device = torch.device(device)
        self.clock = ComputeClock(self.device)  # the step's forward and backward time
        self.state = state or TrainState()
        self.on_phase = on_phase
        self.abort = abort
        self._waiter = Waiter("engine-wait")
        self.waiting: Waiting | None = None
        """The communication the step waits for now (module docstring), None between waits."""
        self._pending: StepResult | None = None
        self.train = job.train
        self.bf16 = job.model.dtype == "bfloat16"
        self.sampler = GlobalSampler(dataset, job.train.microbatch_size,
                                     job.train.global_microbatches, seed=job.model.seed)
        if plan.global_microbatches != job.train.global_microbatches:
            raise ValueError(f"plan splits {plan.global_microbatches} microbatches but the job's "
                             f"train.global_microbatches is {job.train.global_microbatches}")
        self.info = info = plan.ranks[comm.rank]
        self.first = info.stage == 0
        self.last = info.stage == plan.pipelines[info.pipeline].template.num_stages - 1
        self.microbatches = plan.pipelines[info.pipeline].microbatches
        self.mb_offset = sum(p.microbatches for p in plan.pipelines[:info.pipeline])

        # This rank's pipeline only (pipelines exchange no point-to-point traffic), validated
        # before anything runs.
        spec = plan.pipelines[info.pipeline]
        stage_ranks = [[plan.rank_of(spec.nodes[st.node], g) for g in st.gpus]
                       for st in spec.template.stages]
        schedule = pipeline_schedule(stage_ranks, spec.microbatches, job.train.microbatch_size)
        validate(schedule)
        self.actions: list[Action] = schedule[comm.rank]
        fwd = [a for a in self.actions if a.kind == "F"]
        self.rows = fwd[0].rows if fwd else (0, 0)

        # Layers: adopted, allocated for state that is loaded or received, or built fresh.
        adopted = {i: m for i, m in (adopt.layers.items() if adopt is not None else ())
                   if info.layer_start <= i < info.layer_end}
        self.layers: dict[int, nn.Module] = build_layers(
            model, range(info.layer_start, info.layer_end), self.device, adopted,
            loaded=set(layer_states or ()) | set(receive))
        self.dtype = next((p.dtype for m in self.layers.values() for p in m.parameters()),
                          torch.float32)
        self.optimizer = make_optimizer(self.layers.values(), job.train, self.device)
        for layer, module in adopted.items():  # AdamW state moves with its parameters
            for p in module.parameters():
                if p in adopt.optimizer.state:
                    self.optimizer.state[p] = adopt.optimizer.state[p]
        for layer, st in (layer_states or {}).items():
            self.load_layer_state(layer, st)

        self.segments = make_segments(self.layers, plan, comm.rank, groups, self.dtype, self.device,
                                      recompute=job.train.recompute)
        self.tied = TiedGradients.build(model, plan, comm.rank, self.layers, groups.group)

        # Transfers carry the parameters' dtype (fp32; fp64 when a test builds the model so);
        # under bf16 autocast activations are cast up to it before they are sent.
        self.act_slots, self.grad_buf = transfer_buffers(
            model, range(info.layer_start, info.layer_end), self.rows,
            job.data.seq_len or model.seq_len, slots=max(1, max_in_flight(self.actions)),
            first=self.first, last=self.last, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ per-layer state

    def layer_state(self, layer: int) -> dict[str, torch.Tensor]:
        """Weights, buffers and optimizer state of one owned layer (`checkpoint.layer_state`:
        tensors shared, not copied)."""
        return layer_state(self.layers[layer], self.optimizer)

    def load_layer_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        """Overwrite an owned layer's weights, buffers and optimizer state (copies the tensors;
        strict: `checkpoint.load_layer_state`)."""
        load_layer_state(self.layers[layer], self.optimizer, state, layer=layer)

    # ------------------------------------------------------------------ the step

    def _phase(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, self.state.step)

    def step(self, commit: bool = True) -> StepResult:
        """Run one training step on the global batch at `state.cursor`.

        commit=True (default): apply the update and advance the state when the step succeeded.
        commit=False: stop after the global statistics, with the reduced (and clipped) gradients
        ready; the caller then calls `commit()` or `rollback()` -- e.g. after the elastic layer
        confirmed out of band that every rank got this far, which makes the step transactional
        even when a rank dies inside the last all-reduce (some peers may have finished it)."""
        step = self.state.step
        t0 = time.perf_counter()
        self.clock.reset()
        lr = lr_at(step, self.train)
        try:
            loss_sum = self._pipeline(step)
            self._phase("gradient_sync")
            total = self._sync(loss_sum)
        except _Failure as f:
            self._abandon()
            return StepResult(step, False, lr=lr, seconds=time.perf_counter() - t0,
                              error=f.cause, phase=f.phase, peer=f.peer, group=f.group)
        loss = float(total[0]) / self.sampler.global_batch
        norm = math.sqrt(max(float(total[1]), 0.0))
        coef = clip_coefficient(norm, self.train.grad_clip)
        if coef != 1.0:
            for seg in self.segments:
                seg.flat.mul_(coef)
        self._pending = StepResult(step, True, loss=loss, grad_norm=norm, lr=lr,
                                   samples=self.sampler.global_batch,
                                   compute_s=self.clock.seconds())
        if not commit:
            self._pending.seconds = time.perf_counter() - t0
            return self._pending
        result = self.commit()
        result.seconds = time.perf_counter() - t0
        return result

    @property
    def prepared(self) -> StepResult | None:
        """The step prepared by `step(commit=False)` and neither committed nor rolled back."""
        return self._pending

    def commit(self) -> StepResult:
        """Apply the prepared step: AdamW with this step's LR; the state advances. Purely
        local: it needs no peer, so a step whose commit was agreed can be applied after the
        groups are gone (the elastic layer's roll-forward)."""
        result, self._pending = self._pending, None
        if result is None:
            raise RuntimeError("commit() without a prepared step (call step(commit=False) first)")
        self._phase("optimizer")
        set_lr(self.optimizer, result.lr)
        self.optimizer.step()
        self._phase("commit")
        self.state.step += 1
        self.state.cursor += self.sampler.global_batch
        return result

    def rollback(self) -> None:
        """Drop a prepared step: weights, optimizer and state stay as before it."""
        self._pending = None

    def _abandon(self) -> None:
        """Forget everything of a failed step (pending work is owned by the dead groups)."""
        for seg in self.segments:
            seg.work = None
        self._ctx = {}
        self._sends = []
        self._outputs = {}

    def release_step_memory(self) -> None:
        """Free what only a running step needs -- gradient buffers, activation and gradient
        transfer buffers -- keeping layers, AdamW state and TrainState: an engine that will
        never step again but still serves its state (the elastic layer's base engine during a
        recovery, until the new plan's first commit). Needs no prepared step."""
        if self._pending is not None:
            raise RuntimeError("release_step_memory() with a prepared step: commit or roll back")
        self._abandon()
        for seg in self.segments:
            for m in seg.modules:
                for p in m.parameters():
                    p.grad = None  # a view of seg.flat (or of a newer engine's buffer)
            seg.flat = torch.empty(0, dtype=self.dtype, device=self.device)
        self.act_slots = []
        self.grad_buf = None

    def _pipeline(self, step: int) -> torch.Tensor:
        """Run this rank's action list. Each run of consecutive transfers is posted together:
        on gloo as individual isend/irecv (receives waited before the next compute, sends at the
        end of the pipeline); on NCCL as one `batch_isend_irecv` group, waited at once (NCCL
        runs a pair's transfers in order; the validator's `check_batched` proves 1F1B safe)."""
        cursor = self.state.cursor
        for seg in self.segments:
            seg.flat.zero_()
        self._ctx: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._sends: list[tuple[dist.Work, int]] = []
        recvs: list[tuple[dist.Work, int]] = []
        batch: list[tuple[dist.P2POp, int]] = []
        nccl = self.comm.backend == "nccl"
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        r0 = self.rows[0]
        phase = "forward"

        def wait(works: list[tuple[dist.Work, int]]) -> None:
            for work, peer in works:
                try:
                    self._wait(work, phase, (peer,))
                except Exception as e:
                    raise _Failure(phase, peer, None, e) from e

        def flush() -> None:
            nonlocal batch, recvs
            if nccl and batch:
                try:
                    works = dist.batch_isend_irecv([op for op, _ in batch])
                except Exception as e:
                    raise _Failure(phase, batch[0][1], None, e) from e
                wait([(w, batch[0][1]) for w in works])
            else:
                wait(recvs)
            batch, recvs = [], []

        self._phase(phase)
        for a in self.actions:
            if a.kind == "B" and phase == "forward":
                phase = "backward"
                self._phase(phase)
            try:
                if a.kind in ("RECV_ACT", "RECV_GRAD"):
                    buf = (self.act_slots[a.microbatch % len(self.act_slots)]
                           if a.kind == "RECV_ACT" else self.grad_buf)
                    view = buf[a.rows[0] - r0:a.rows[1] - r0]
                    if nccl:
                        batch.append((dist.P2POp(dist.irecv, view, a.peer), a.peer))
                    else:
                        recvs.append((dist.irecv(view, src=a.peer), a.peer))
                elif a.kind in ("SEND_ACT", "SEND_GRAD"):
                    t = self._outputs[(a.kind, a.microbatch)]
                    view = t[a.rows[0] - r0:a.rows[1] - r0].contiguous()
                    if nccl:
                        batch.append((dist.P2POp(dist.isend, view, a.peer), a.peer))
                    else:
                        self._sends.append((dist.isend(view, dst=a.peer), a.peer))
                else:
                    flush()
                    start = self.clock.start()
                    if a.kind == "F":
                        loss_sum += self._forward(a, cursor)
                    else:
                        self._backward(a)
                    self.clock.stop(start)
            except _Failure:
                raise
            except Exception as e:
                raise _Failure(phase, a.peer if a.peer >= 0 else None, None, e) from e
        flush()
        wait(self._sends)
        self._sends = []
        return loss_sum

    def _forward(self, a: Action, cursor: int) -> torch.Tensor:
        k = a.microbatch
        if self.first or self.last:
            x_tok, y = self.sampler.microbatch(cursor, self.mb_offset + k, a.rows)
        if self.first:
            x = x_tok.to(self.device)
        else:
            x = self.act_slots[k % len(self.act_slots)].detach().requires_grad_()
        ctx = []
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for i, seg in enumerate(self.segments):
                inp = x if i == 0 else x.detach().requires_grad_()
                x = seg.forward(inp)
                ctx.append((inp, x))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.last:
            per_sample = self.model.loss(x, y.to(self.device))
            total = per_sample.sum()
            loss_sum = total.detach().double()
            ctx[-1] = (ctx[-1][0], total / self.sampler.global_batch)
        else:
            self._outputs[("SEND_ACT", k)] = x.detach().to(self.dtype)
        self._ctx[k] = ctx
        return loss_sum

    def _backward(self, a: Action) -> None:
        k = a.microbatch
        ctx = self._ctx.pop(k)
        self._outputs.pop(("SEND_ACT", k), None)
        grad = None if self.last else self.grad_buf
        final = k == self.microbatches - 1
        for i in range(len(ctx) - 1, -1, -1):
            inp, out = ctx[i]
            torch.autograd.backward(out, grad_tensors=grad if grad is None else grad.to(out.dtype))
            grad = inp.grad
            if final:
                self.segments[i].start_all_reduce()
        if not self.first:
            self._outputs[("SEND_GRAD", k)] = grad

    def _wait(self, work: dist.Work, phase: str, ranks: tuple[int, ...],
              sync: bool = False) -> None:
        """Wait for `work` (in `phase`, on `ranks`: published as `waiting` meanwhile), bounded
        by the collective timeout; when `abort()` turns true the step gives up at once instead
        of waiting out the timeout for a peer that already left the step (`Comm.wait`: NCCL
        never blocks the CPU unless `sync`, gloo waits on the engine's one helper thread). The
        abandoned work's groups are dropped by the caller (groups.Comm.abandon)."""
        self.waiting = Waiting(time.monotonic(), phase, ranks)
        try:
            self.comm.wait(work, self._waiter, self.abort, sync=sync)
        finally:
            self.waiting = None

    def _sync(self, loss_sum: torch.Tensor) -> torch.Tensor:
        if self.microbatches == 0:  # a pipeline with no samples still joins the reductions
            for seg in self.segments:
                seg.start_all_reduce()
        for seg in self.segments:
            if seg.work is not None:
                try:
                    self._wait(seg.work, "gradient_sync", seg.owners)
                except Exception as e:
                    raise _Failure("gradient_sync", None, seg.owners, e) from e
                seg.work = None
        for t in self.tied.tensors:  # shared tensors: both copies' gradients summed (tied.py)
            try:
                self.tied.reduce(t, partial(self._wait, phase="gradient_sync", ranks=t.holders))
            except Exception as e:
                raise _Failure("gradient_sync", None, t.holders, e) from e
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for seg in self.segments:
            if seg.counts_norm:
                sq += self.tied.square_norm(seg.flat, seg.modules)
        stats = torch.stack([loss_sum.double(), sq])
        world = tuple(range(self.comm.world_size))
        try:
            work = dist.all_reduce(stats, op=dist.ReduceOp.SUM, async_op=True)
        except Exception as e:
            raise _Failure("reduce", None, world, e) from e
        self._phase("reduce")
        try:
            # Abortable like every other wait: completing it commits nothing by itself (with
            # step(commit=False) the caller decides, after a vote, whether the step commits).
            # Its result is read on the CPU next: on NCCL the wait is synchronous.
            self._wait(work, "reduce", world, sync=True)
        except Exception as e:
            raise _Failure("reduce", None, world, e) from e
        return stats.cpu()

    # ------------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Drop the layers, optimizer and buffers (the process groups belong to the caller).
        Layers another engine adopted stay alive there."""
        self.layers.clear()
        self.segments = []
        self.act_slots = []
        self.grad_buf = None
        self.optimizer = None  # type: ignore[assignment]
        self._waiter.close()
