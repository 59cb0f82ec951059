"""A pool of long-lived worker processes that run plan after plan: for tests and benchmarks.

Importing torch costs seconds per process on a small machine, so the pool starts
`nodes x gpus_per_node` workers ONCE and then runs any number of plans in them. Each plan is a
new generation: the workers that the plan uses `Comm.init` a fresh world (store prefix
gen<N>), build its groups and an Engine, run the steps, report, and `Comm.destroy()` -- the
same in-place rebuild the elastic layer does after a failure. Workers whose node is not in the
plan sit that generation out.

Worker w is GPU w % G of node f"node{w // G}"; its rank in a plan is `plan.rank_of(node, gpu)`.
Results come back over pipes as numpy arrays (no shared-memory tensors).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from oobleck_hpc.config import JobConfig
from oobleck_hpc.planning.plan import Plan


@dataclass
class Task:
    kind: str
    """'engine': train the plan; 'reference': single-process reference (worker 0 only);
    'ddp': torch DDP over all workers (pure data parallelism, the speed baseline)."""
    job: JobConfig
    plan: Plan | None
    steps: int
    generation: int
    dataset: Any
    return_params: bool = True
    float64: bool = False
    fault: tuple[int, int, str] | None = None
    two_phase: bool = False
    """Every step: step(commit=False), rollback(), then step(commit=False), commit()."""
    resume: tuple[dict, tuple[int, int]] | None = None
    """(layer -> layer_state as numpy, (step, cursor)): start the engine from this state
    instead of fresh layers (what a reconfiguration or a checkpoint restore does)."""
    """(rank, step, phase): that rank leaves the world abruptly (destroys its process groups
    without a word) when the step enters the phase; the others must report the failure."""
    """Build the model in float64 (default dtype) for this task: exactness checks."""


def node_name(i: int) -> str:
    return f"node{i}"


def _worker(worker: int, gpus_per_node: int, store_port: int, conn) -> None:
    import datetime
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool asks for stacks on a hang
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    node, gpu = node_name(worker // gpus_per_node), worker % gpus_per_node
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            torch.set_default_dtype(torch.float64 if task.float64 else torch.float32)
            conn.send(("ok", _run(task, worker, node, gpu, store)))
        except BaseException as e:  # report, keep the worker alive for the next task
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class _Injected(Exception):
    pass


def _params_numpy(modules: dict) -> dict:
    return {(layer, name): p.detach().cpu().numpy().copy()
            for layer, m in modules.items() for name, p in m.named_parameters()}


def _run(task: Task, worker: int, node: str, gpu: int, store) -> dict | None:
    import torch
    import torch.distributed as dist

    from oobleck_hpc.engine import Engine, Reference, TrainState
    from oobleck_hpc.engine.groups import Comm, PlanGroups
    from oobleck_hpc.engine.tied import tied_layers
    from oobleck_hpc.models.base import build_model

    job = task.job
    model = build_model(job.model)
    if task.kind == "reference":
        if worker != 0:
            return None
        ref = Reference(job, model, task.dataset)
        losses, times = [], []
        for _ in range(task.steps):
            t0 = time.perf_counter()
            losses.append(ref.step())
            times.append(time.perf_counter() - t0)
        params = _params_numpy(dict(enumerate(ref.layers))) if task.return_params else {}
        return {"losses": losses, "times": times, "params": params}

    if task.kind == "ddp":
        return _run_ddp(task, worker, store, model)

    plan = task.plan
    if node not in plan.nodes:
        return None
    rank = plan.rank_of(node, gpu)
    comm = Comm.init(store, rank, plan.world_size, task.generation, "gloo",
                     job.fault_tolerance.collective_timeout_s)
    try:
        groups = PlanGroups.build(plan, comm, tied_layers(model))
        on_phase = None
        if task.fault is not None and task.fault[0] == rank:
            def on_phase(phase: str, step: int) -> None:
                if (step, phase) == tuple(task.fault[1:]):
                    dist.destroy_process_group()
                    raise _Injected()
        layer_states, state = None, None
        if task.resume is not None:
            states, (step, cursor) = task.resume
            layer_states = {layer: {k: torch.from_numpy(v) for k, v in states[layer].items()}
                            for layer in range(plan.ranks[rank].layer_start,
                                               plan.ranks[rank].layer_end)}
            state = TrainState(step, cursor)
        engine = Engine(job, model, plan, comm, groups, task.dataset, torch.device("cpu"),
                        state=state, layer_states=layer_states, on_phase=on_phase)
        losses, times, norms = [], [], []
        for _ in range(task.steps):
            t0 = time.perf_counter()
            try:
                if task.two_phase:
                    engine.step(commit=False)
                    engine.rollback()
                    r = engine.step(commit=False)
                    r = engine.commit() if r.ok else r
                else:
                    r = engine.step()
            except _Injected:
                return {"rank": rank, "injected": True, "state": (engine.state.step, engine.state.cursor)}
            if not r.ok:
                if task.fault is None:
                    raise RuntimeError(f"step {r.step} failed in {r.phase} (peer {r.peer}): {r.error!r}")
                return {"rank": rank, "failed": r.step, "phase": r.phase, "peer": r.peer,
                        "group": r.group, "error": repr(r.error),
                        "seconds": time.perf_counter() - t0,
                        "state": (engine.state.step, engine.state.cursor)}
            losses.append(r.loss)
            norms.append(r.grad_norm)
            times.append(r.seconds)
        params = _params_numpy(engine.layers) if task.return_params else {}
        states = ({layer: {k: v.detach().cpu().numpy().copy()
                           for k, v in engine.layer_state(layer).items()}
                   for layer in engine.layers} if task.return_params else {})
        return {"rank": rank, "losses": losses, "norms": norms, "times": times, "params": params,
                "layer_states": states, "state": (engine.state.step, engine.state.cursor)}
    finally:
        comm.destroy()


def _run_ddp(task: Task, worker: int, store, model) -> dict:
    """torch DDP doing the same per-rank work as the engine on a pure data-parallel plan: the
    rank of pipeline p, replica j of the plan's single stage, runs rows split_rows(b, G)[j] of
    each of pipeline p's microbatches, then DDP's bucketed all-reduce (overlapped with the last
    backward) averages the gradients; same clipping, LR and AdamW. A Hugging Face model runs as
    the plain transformers model (`HFModel.whole_model`), one tied tensor included."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oobleck_hpc.engine.groups import Comm
    from oobleck_hpc.engine.optim import lr_at, make_optimizer, set_lr
    from oobleck_hpc.engine.sampler import GlobalSampler
    from oobleck_hpc.engine.schedule import split_rows

    job, plan = task.job, task.plan
    if any(p.template.num_stages != 1 for p in plan.pipelines):
        raise ValueError("the DDP baseline needs a pure data-parallel plan (single-stage templates)")
    node, gpu = node_name(worker // plan.gpus_per_node), worker % plan.gpus_per_node
    if node not in plan.nodes:
        return None
    rank = plan.rank_of(node, gpu)
    info = plan.ranks[rank]
    world = plan.world_size
    comm = Comm.init(store, rank, world, task.generation, "gloo",
                     job.fault_tolerance.collective_timeout_s)
    try:
        hf = hasattr(model, "whole_model")  # a Hugging Face model: the plain transformers one
        net = model.whole_model() if hf else nn.Sequential(
            *[model.build_layer(i) for i in range(model.num_layers)])
        ddp = DDP(net, gradient_as_bucket_view=True)
        opt = make_optimizer([net], job.train, torch.device("cpu"))
        sampler = GlobalSampler(task.dataset, job.train.microbatch_size,
                                job.train.global_microbatches, seed=job.model.seed)
        offset = sum(p.microbatches for p in plan.pipelines[:info.pipeline])
        count = plan.pipelines[info.pipeline].microbatches
        rows = split_rows(job.train.microbatch_size, info.replicas)[info.replica]
        cursor, times, losses = 0, [], []
        for step in range(task.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            total = torch.zeros(())
            for k in range(count):
                x, y = sampler.microbatch(cursor, offset + k, rows)
                ctx = ddp.no_sync() if k < count - 1 else _nullcontext()
                with ctx:
                    out = ddp(x)
                    loss = model.loss(out.logits if hf else out, y).sum()
                    (loss * world / sampler.global_batch).backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(net.parameters(), job.train.grad_clip)
            set_lr(opt, lr_at(step, job.train))
            opt.step()
            cursor += sampler.global_batch
            times.append(time.perf_counter() - t0)
            losses.append(float(total))
        out = {"rank": rank, "times": times, "losses": losses, "params": {}}
        # Free DDP (its reducer holds the process group) BEFORE the group is destroyed: freeing
        # it afterwards, on the way out of this frame, was seen to hang in the destructor.
        del ddp
        gc.collect()
        return out
    finally:
        comm.destroy()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class WorkerPool:
    """`nodes x gpus_per_node` spawned workers sharing one TCPStore hosted here."""

    def __init__(self, nodes: int, gpus_per_node: int, start_timeout_s: float = 120.0):
        import datetime

        import torch.distributed as dist

        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        self.generation = 0
        for w in range(nodes * gpus_per_node):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(w, gpus_per_node, self.store.port, child),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        deadline = time.monotonic() + start_timeout_s
        for c in self.conns:
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise TimeoutError(f"workers did not start within {start_timeout_s} s")
            c.recv()

    @property
    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(self.nodes)]

    def run(self, kind: str, job: JobConfig, plan: Plan | None, steps: int, dataset: Any,
            timeout_s: float = 120.0, return_params: bool = True, float64: bool = False,
            fault: tuple[int, int, str] | None = None, two_phase: bool = False,
            resume: tuple[dict, tuple[int, int]] | None = None) -> list[dict | None]:
        """Run one task in every worker; results indexed by worker."""
        self.generation += 1
        task = Task(kind, job, plan, steps, self.generation, dataset, return_params, float64,
                    fault, two_phase, resume)
        for c in self.conns:
            c.send(task)
        out, errors = [], []
        deadline = time.monotonic() + timeout_s
        for w, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                stuck = [i for i, cc in enumerate(self.conns) if i >= w and not cc.poll(0)]
                for i in stuck:  # print their Python stacks on stderr (faulthandler)
                    os.kill(self.procs[i].pid, signal.SIGUSR1)
                time.sleep(2.0)
                raise TimeoutError(f"workers {stuck} did not finish {kind} (generation "
                                   f"{self.generation}) within {timeout_s} s; stacks above")
            status, value = c.recv()
            if status == "error":
                errors.append(f"worker {w}: {value}")
                value = None
            out.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive():
                    c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.conns, self.procs = [], []
