"""A training worker, top to bottom: config -> bootstrap -> profile -> plan -> run loop.

One process per GPU (on CPU: per pretend GPU), started by its node agent (`python -m
oobleck_hpc.control.agent`; the local launcher and Slurm both run one per node) with the OOBLECK_*
environment (bootstrap/environment.py, control/client.py): this node's name, local rank, the link
to the agent, and in `extra` the job file (OOBLECK_JOB), the run directory (OOBLECK_RUN_DIR) and
the metrics file (OOBLECK_METRICS, optional). The membership the agent sends names the nodes and
who hosts the rendezvous store. Every rank computes the same plan from the same profile and node
list; its rank is derived from the plan (node order, GPU index). A lost node is recovered in
place by the elastic driver (recovery/driver.py) inside `driver.step()`; beyond the guarantee the
checkpoint fallback takes over (checkpoint/resume.py). For exact comparisons with a reference (tests,
`oobleck-hpc chaos`): `model.dtype: float64` builds the model in fp64, and
`train.save_final_params: true` writes the final parameters to RUN_DIR/final (one file per layer).

    python -m oobleck_hpc.train        # with the environment above; `oobleck-hpc run` sets it
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from oobleck_hpc.bootstrap import NodeEnvironment, detect
from oobleck_hpc.checkpoint import read_latest_pointer
from oobleck_hpc.checkpoint.resume import Resume
from oobleck_hpc.config import JobConfig, load_job
from oobleck_hpc.control.auth import run_secret
from oobleck_hpc.control.client import AgentClient
from oobleck_hpc.control.faults import FaultInjector
from oobleck_hpc.control.membership import Fenced
from oobleck_hpc.data import dataset_for
from oobleck_hpc.engine import Engine
from oobleck_hpc.errors import EXIT_OK, EXIT_REQUEUE, ConfigError, GuaranteeExceeded, OobleckError
from oobleck_hpc.files import atomic_open
from oobleck_hpc.models.base import build_model
from oobleck_hpc.profiling import resolve_profile
from oobleck_hpc.profiling.profile import ModelProfile
from oobleck_hpc.records.events import EventLog
from oobleck_hpc.records.progress import Progress
from oobleck_hpc.recovery.driver import ElasticDriver
from oobleck_hpc.recovery.planned import Drained
from oobleck_hpc.recovery.rounds import RecoveryError


def pick_device(job, env):
    """This worker's device. Pretend nodes of a local launch share the machine's GPUs, so a
    worker takes GPU (node index x gpus_per_node + local rank); NCCL needs one GPU per rank, so
    `device: auto` falls back to the CPU when there are fewer GPUs than local workers."""
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


@dataclass
class Worker:
    """What a worker sets up before its first rendezvous (`setup`)."""

    env: NodeEnvironment
    client: AgentClient
    job: JobConfig
    run_dir: Path
    device: torch.device
    events: EventLog
    faults: FaultInjector | None
    profile: ModelProfile
    driver: ElasticDriver
    first_step: int  # the latest checkpoint's step (0: none)


@dataclass(frozen=True)
class Ending:
    """How the worker ends: its exit code, and whether it tells its agent (a drained node left
    through `client.leave` already)."""

    code: int
    tell_agent: bool = True


def main(env: NodeEnvironment, client: AgentClient) -> int:
    """The worker's story: set up, rendezvous (or join), train, end; the agent learns the exit
    code unless the node left on notice (an exception: entry() reports an intended exit,
    anything else is a crash of the node)."""
    w = setup(env, client)
    try:
        end = train_or_fall_back(w)
    finally:
        w.driver.close()
    if end.tell_agent:
        client.done(end.code)
    return end.code


def setup(env: NodeEnvironment, client: AgentClient) -> Worker:
    """Who am I, and what is the job: config, device, model, data, profile, and the elastic
    driver (the agent started this process and owns its link, `client`)."""
    job = load_job(env.extra["job"])
    run_dir = Path(env.extra.get("run_dir") or job.resolved_run_dir)
    secret = run_secret(run_dir)  # (the store's key prefix; none readable: exit 2, naming it)
    device = pick_device(job, env)
    if job.model.dtype == "float64":  # exact comparisons with the fp64 reference
        torch.set_default_dtype(torch.float64)
    model = build_model(job.model, job.source)
    events = EventLog(run_dir / "events.jsonl", source=f"{env.node}/{env.local_rank}")
    faults = FaultInjector.for_node(job.faults, int(os.environ.get("OOBLECK_NODE_INDEX", "-1")),
                                    env.node, env.local_rank, events, client)
    if env.extra.get("rejoin_after_gen"):  # restarted after a crash: no fault fires twice
        faults.skip_fired()
    dataset = dataset_for(job.data, model, job.source)
    # Profile, plan, rendezvous (generation 0: every rank computes the same plan from the same
    # inputs; the store is hosted by the node the membership names).
    profile = resolve_profile(job)
    driver = ElasticDriver(job, model, profile, dataset, device, client, events, faults,
                           secret=secret)
    client.set_notice_handler(driver.on_notice)
    first_step = (read_latest_pointer(job.checkpoint.dir) or 0) if job.checkpoint.dir else 0
    return Worker(env, client, job, run_dir, device, events, faults, profile, driver, first_step)


def train_or_fall_back(w: Worker) -> Ending:
    """Rendezvous and train; beyond in-place recovery, resume from the latest checkpoint. A
    node fenced because its survivors could not prove a quorum (exit_code 75) falls back too;
    one excluded by its peers (they go on without it) just stops (raises)."""
    ckpt = None
    try:
        ckpt = rendezvous(w)
        return train(w, ckpt)
    except (GuaranteeExceeded, RecoveryError, Fenced) as e:
        if e.exit_code != EXIT_REQUEUE:
            raise
        return Ending((ckpt or Resume.unstarted(w.job, w.run_dir, w.device, w.events)).fallback(e))


def joins(w: Worker) -> bool:
    """A spare, or a worker of a node back after a crash: it joins a running generation."""
    return bool(w.env.extra.get("spare") or w.env.extra.get("rejoin_after_gen"))


def rendezvous(w: Worker) -> Resume:
    """Generation 0's plan and groups and this rank's engine, restored from the latest
    checkpoint (if any; checkpoint/resume.py); a node lost meanwhile: rendezvous again among
    the survivors and restore again. A spare (cluster.spares) waits until a loss swaps it in,
    then receives its layers and the step to train from the members (recovery/join.py); the
    workers of a node that stepped out after a crash (control/agent.py) join the same way."""
    job, env, driver, faults = w.job, w.env, w.driver, w.faults
    if joins(w):
        after = env.extra.get("rejoin_after_gen")
        if after:
            plan, comm = driver.join(env.extra["first_nodes"].split(","), int(after))
        else:
            plan, comm = driver.join([n for n in env.nodes if n != env.node])
        return Resume.start(job, plan, comm.rank, comm, w.device, w.run_dir, w.profile, faults,
                            w.events, restore=False)
    first_step = w.first_step
    plan, comm = driver.start(first_step)
    while True:
        try:
            if faults is not None:
                faults("restore", first_step + 1)
            ckpt = Resume.start(job, plan, comm.rank, comm, w.device, w.run_dir, w.profile,
                                faults, w.events, abort=driver.round_opened)
            break
        except (RuntimeError, TimeoutError) as e:
            plan, comm = driver.start(first_step, failed=f"restore: {e!r}")
    driver.build_engine(state=ckpt.state, layer_states=ckpt.layer_states)
    return ckpt


def train(w: Worker, ckpt: Resume) -> Ending:
    """The run loop: each step commits only when every rank holds it (the commit vote); a lost
    node is recovered in place inside driver.step() (oobleck_hpc/recovery/driver.py). Ends at
    the last step, or earlier: drained, a forced drain, a stop signal."""
    job, driver, d = w.job, w.driver, w.driver.state  # d: the driver's state (recovery/state.py)
    metrics = Path(w.env.extra["metrics"]) if w.env.extra.get("metrics") else None
    progress = Progress(job.train.steps, job.train.log_every, metrics, run=w.events.run,
                        attempt=w.events.attempt, joined=joins(w))
    t0 = time.perf_counter()
    while d.engine.state.step < job.train.steps:
        try:
            results = driver.step(ckpt.ballot(d.engine))
        except Drained as e:
            # This node leaves on notice at a step boundary (control/drain.py): its in-flight
            # checkpoint shards first, then the agent lets it go.
            ckpt.finish()
            w.client.leave(drained=True, bye=e.bye)
            return Ending(EXIT_OK, tell_agent=False)
        progress.record(results, d.plan.digest(), d.gen, active=d.rank == 0)
        if d.stop_for is not None:  # a forced drain the survivors cannot absorb
            v = d.stop_for
            staying = [n for n in d.plan.nodes if n not in v.leaving]
            # (every node asked, as a job-wide SIGUSR1 does: requeued on all)
            return Ending(ckpt.leave(f"drain of {', '.join(v.leaving)} forced: {v.reason}",
                                     d.engine, staying or list(d.plan.nodes)))
        # Periodic checkpoint, heartbeat; a stop signal saves and leaves for a requeue (75).
        code = ckpt.after_step(d.engine, d.agreed)
        if code is not None:
            return Ending(code)
    finish(w, ckpt, progress, t0)
    return Ending(EXIT_OK)


def finish(w: Worker, ckpt: Resume, progress: Progress, t0: float) -> None:
    """Every rank reached the end, its final layers written (a node lost after the last vote
    is recovered from here, or falls back when its layers are gone); rank 0 tells the run's
    verdict (oobleck_hpc/records/runs.py): every step of the job is committed."""
    job, d = w.job, w.driver.state
    w.driver.finish(lambda: save_final_state(d.engine, job, w.run_dir))
    ckpt.finish(d.engine)
    wall = time.perf_counter() - t0
    progress.finish()
    if d.rank == 0:
        losses = progress.losses
        w.events.emit("run_finished", steps=d.engine.state.step, total=job.train.steps,
                      model=job.model.name,
                      wall_s=round(wall, 3), first_loss=losses[0] if losses else math.nan,
                      last_loss=losses[-1] if losses else math.nan,
                      samples_per_s=round(progress.samples / max(wall, 1e-9), 2),
                      plan=d.plan.digest(), nodes=len(d.plan.nodes),
                      recoveries=len(d.recoveries))


def save_final_state(engine: Engine, job: JobConfig, run_dir: Path) -> None:
    """With `train.save_final_params` (tests, `oobleck-hpc chaos`): each layer's final
    parameters land in RUN_DIR/final/layer-<i>.pt, to compare with a failure-free reference.
    Every holder of a layer writes it unless it is there already (replicas are equal after a
    committed step); after a node lost at the end, the new plan's holders write what is missing
    (`ElasticDriver.finish` calls this again with the new plan's engine)."""
    if not job.train.save_final_params:
        return
    out = run_dir / "final"
    out.mkdir(parents=True, exist_ok=True)
    for layer, module in engine.layers.items():
        if not (out / f"layer-{layer}.pt").exists():
            state = {n: p.detach().cpu() for n, p in module.named_parameters()}
            with atomic_open(out / f"layer-{layer}.pt") as f:
                torch.save(state, f)


def entry() -> int:
    from oobleck_hpc.diagnostics import configure

    configure("WARNING")  # the level `oobleck-hpc --log-level` exported (OOBLECK_LOG_LEVEL)
    client = None
    try:
        env = detect()
        client = AgentClient.from_env()  # first: bad input below is reported through it
        return main(env, client)
    except OobleckError as e:
        print(f"oobleck-hpc worker: error: {e}", file=sys.stderr, flush=True)
        if client is not None:
            try:
                client.done(e.exit_code, reason=str(e))
            except OobleckError:
                pass
        return e.exit_code


if __name__ == "__main__":
    code = entry()
    # Leave without the interpreter's teardown: the process groups dropped after a failure are
    # kept alive on purpose (engine/groups.py, Comm.abandon), and destroying them at exit aborts
    # the process (std::terminate: "terminate called without an active exception", exit -6)
    # after a clean run. Everything the worker writes is flushed and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
