"""A training worker, top to bottom: config -> bootstrap -> profile -> plan -> run loop.

One process per GPU (on CPU: per pretend GPU), started by a launcher (launch/local.py) or a node
agent with the OOBLECK_* environment (bootstrap/environment.py): this node's name, the job's
nodes, the local rank, and in `extra` the job file (OOBLECK_JOB), the run directory
(OOBLECK_RUN_DIR), the rendezvous store (OOBLECK_STORE=host:port) and the metrics file
(OOBLECK_METRICS, optional). Every rank computes the same plan from the same profile and node
list; its rank is derived from the plan (node order, GPU index).

    python -m oobleck_hpc.train        # with the environment above; `oobleck-hpc run` sets it
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from oobleck_hpc.errors import EXIT_OK, EXIT_UNRECOVERABLE, GuaranteeExceeded, OobleckError


@dataclass
class Progress:
    """Rank 0's view of the run: a tqdm bar on a TTY, a log line every `log_every` steps
    otherwise, and one JSON line per step in the metrics file."""

    total: int
    log_every: int
    metrics: Path | None
    plan_id: str
    generation: int
    bar: object = None
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="step", dynamic_ncols=True)
        if self.metrics is not None:
            self.metrics.parent.mkdir(parents=True, exist_ok=True)

    def step(self, r) -> None:
        self.losses.append(r.loss)
        self.samples += r.samples
        self.seconds += r.seconds
        if self.metrics is not None:
            with open(self.metrics, "a") as f:
                f.write(json.dumps({"step": r.step, "loss": r.loss, "samples": r.samples,
                                    "seconds": r.seconds, "grad_norm": r.grad_norm, "lr": r.lr,
                                    "plan": self.plan_id, "generation": self.generation,
                                    "time": time.time()}) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{r.loss:.4f}", refresh=False)
        elif (r.step + 1) % self.log_every == 0 or r.step + 1 == self.total:
            print(f"step {r.step + 1}/{self.total}  loss {r.loss:.4f}  "
                  f"{r.samples / max(r.seconds, 1e-9):.1f} samples/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe_plan(plan) -> str:
    lines = [f"plan {plan.digest()}: {len(plan.pipelines)} pipelines on {len(plan.nodes)} nodes, "
             f"{plan.world_size} ranks, {plan.global_microbatches} microbatches, predicted "
             f"{plan.predicted_iteration_ms:.1f} ms/step"]
    for i, p in enumerate(plan.pipelines):
        stages = " | ".join(f"L{s.layer_start}-{s.layer_end - 1}@{p.nodes[s.node]}:{','.join(map(str, s.gpus))}"
                            for s in p.template.stages)
        lines.append(f"  pipeline {i}: {p.template.num_nodes}-node template, "
                     f"{p.microbatches} microbatches: {stages}")
    return "\n".join(lines)


def pick_device(job, env):
    """This worker's device. Pretend nodes of a local launch share the machine's GPUs, so a
    worker takes GPU (node index x gpus_per_node + local rank); NCCL needs one GPU per rank, so
    `device: auto` falls back to the CPU when there are fewer GPUs than local workers."""
    import torch

    from oobleck_hpc.errors import ConfigError

    g = job.cluster.gpus_per_node
    index = env.local_rank
    if env.source == "local" and len(env.nodes) > 1:
        index = env.nodes.index(env.node) * g + env.local_rank
    kind = job.cluster.device
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        kind = "cuda" if have > index and (env.source != "local" or have >= len(env.nodes) * g) else "cpu"
    if kind == "cuda":
        if index >= have:
            raise ConfigError(job.source, "cluster.device", f"value 'cuda' needs GPU {index} on "
                              f"{env.node} but {have} are visible",
                              "use device: cpu, or fewer nodes/gpus_per_node on this machine")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return torch.device("cpu")


def connect_store(address: str, timeout_s: float = 120.0):
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def main() -> int:
    from oobleck_hpc.bootstrap import detect
    from oobleck_hpc.config import load_job
    from oobleck_hpc.data import dataset_for
    from oobleck_hpc.engine import Comm, Engine, PlanGroups, default_backend
    from oobleck_hpc.models.base import build_model
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.resume import Resume

    # Who am I, and what is the job.
    env = detect()
    job = load_job(env.extra["job"])
    run_dir = Path(env.extra.get("run_dir") or job.resolved_run_dir)
    device = pick_device(job, env)
    model = build_model(job.model, job.source)

    # Profile and plan: every rank computes the same plan from the same inputs.
    profile = resolve_profile(job)
    _, _, plan = plan_job(job, profile, list(env.nodes))
    rank = plan.rank_of(env.node, env.local_rank)
    if rank == 0:
        print(describe_plan(plan), flush=True)

    # Rendezvous and process groups (generation 0).
    store = connect_store(env.extra["store"])
    comm = Comm.init(store, rank, plan.world_size, plan.generation,
                     default_backend(device.type), job.fault_tolerance.collective_timeout_s)
    try:
        groups = PlanGroups.build(plan, comm)
        dataset = dataset_for(job.data, model.seq_len)
        # Restore the latest checkpoint (if any) onto this run's plan (oobleck_hpc/resume.py).
        ckpt = Resume.start(job, plan, rank, comm, device, run_dir, profile)
        engine = Engine(job, model, plan, comm, groups, dataset, device, state=ckpt.state,
                        layer_states=ckpt.layer_states)

        # The run loop: a step either commits or comes back as a failure value.
        metrics = Path(env.extra["metrics"]) if env.extra.get("metrics") and rank == 0 else None
        progress = Progress(job.train.steps, job.train.log_every, metrics, plan.digest(),
                            plan.generation) if rank == 0 else None
        t0 = time.perf_counter()
        while engine.state.step < job.train.steps:
            result = engine.step()
            if not result.ok:
                # In-place recovery belongs to the elastic layer (oobleck_hpc/elastic); without
                # it a failed step ends the run.
                print(f"rank {rank}: step {result.step} failed in {result.phase} "
                      f"(peer {result.peer}, group {result.group}): {result.error!r}",
                      file=sys.stderr, flush=True)
                return EXIT_UNRECOVERABLE
            if progress is not None:
                progress.step(result)
            # Periodic checkpoint, heartbeat; a stop signal saves and leaves for a requeue (75).
            if (code := ckpt.after_step(engine)) is not None:
                return code
        ckpt.finish(engine)
        wall = time.perf_counter() - t0
        if progress is not None:
            progress.close()
            print(summary(job, plan, progress, wall, run_dir), flush=True)
        return EXIT_OK
    except GuaranteeExceeded as e:  # beyond in-place recovery: resume from the latest checkpoint
        return ckpt.fallback(e)
    finally:
        comm.destroy()


def summary(job, plan, progress: Progress, wall: float, run_dir: Path) -> str:
    steps = len(progress.losses)
    first = progress.losses[0] if steps else math.nan
    last = progress.losses[-1] if steps else math.nan
    return (f"done: {steps} steps of {job.model.name} in {wall:.1f} s; loss {first:.4f} -> "
            f"{last:.4f}; {progress.samples / max(wall, 1e-9):.1f} samples/s; "
            f"plan {plan.digest()} ({len(plan.pipelines)} pipelines, "
            f"{len({p.template for p in plan.pipelines})} templates, "
            f"{len(plan.nodes)} nodes x {plan.gpus_per_node} GPUs); run dir {run_dir}")


def entry() -> int:
    try:
        return main()
    except OobleckError as e:
        print(f"oobleck-hpc worker: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(entry())
