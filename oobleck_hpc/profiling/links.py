"""Measure the links between processes (`measure_links`) and, on a CPU host, how much slower
workers run when several share a core (`measure_core_sharing`).

Links (alpha-beta fits, `LinkCost(latency_ms, bandwidth)`):

- `procs` local processes (gloo on CPU; NCCL when at least two GPUs are visible) exchange
  messages of `sizes` bytes. Point-to-point: ping-pong between ranks 0 and 1, one-way time =
  round trip / 2; fitted to t(n) = latency + n / bandwidth by least squares on the relative
  error (the sizes span 4 KB to 4 MB; unweighted, the largest sizes would set the latency that
  the small messages -- activations, the step's statistics -- pay). All-reduce: all
  ranks, float32 sum; fitted to the planner's own all-reduce equation
  (`planning.cost.allreduce_ms(link, n, p)`, linear in latency and in 1/bandwidth), so the
  planner's prediction reproduces the measured curve for p participants.
- On one machine there is no second node: the "inter-node" links are the same loopback
  measurement, and `interconnect` says so (profiler.profile_job).

Core sharing (CPU only; `MachineProfile.core_sharing`): the local launcher runs every node's
workers on one host, often more of them than it has cores. k x cores processes (k = 1 ..
`sharing_levels`) run the whole model's forward + backward at once, for `sharing_seconds`; entry
k-1 = their mean iteration time / the time of one process alone on the idle host.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.multiprocessing as tmp

from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import ProfileError
from oobleck_hpc.models.base import build_model
from oobleck_hpc.planning.cost import allreduce_ms, host_cores
from oobleck_hpc.profiling.profile import LinkCost
from oobleck_hpc.profiling.timing import TOKEN_RANGE, ProfilerOptions


def _comm_worker(rank: int, world: int, backend: str, init_file: str, sizes: tuple[int, ...],
                 repeats: int, result_file: str) -> None:
    import torch.distributed as dist

    use_cuda = backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=60))

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize()

    p2p, allreduce = [], []
    try:
        for n in sizes:
            buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=dev)
            # point-to-point ping-pong between ranks 0 and 1 (others idle)
            times = []
            for rep in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                sync()
                if rep:
                    times.append((time.perf_counter() - t0) / 2)
            p2p.append(statistics.median(times))
            times = []
            for rep in range(repeats + 1):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                sync()
                if rep:
                    times.append(time.perf_counter() - t0)
            allreduce.append(statistics.median(times))
        if rank == 0:
            np.savez(result_file, sizes=np.array([4 * max(1, n // 4) for n in sizes]),
                     p2p=np.array(p2p), allreduce=np.array(allreduce))
    finally:
        dist.destroy_process_group()


def _fit(design: np.ndarray, t_ms: np.ndarray) -> tuple[float, float]:
    """Least squares on the relative error for (latency_ms, ms_per_byte_inverse_bandwidth), both
    kept positive: every row is divided by its measured time."""
    w = 1.0 / np.maximum(t_ms, 1e-9)
    design, t_ms = design * w[:, None], t_ms * w
    coef, *_ = np.linalg.lstsq(design, t_ms, rcond=None)
    lat, inv_bw = float(coef[0]), float(coef[1])
    if lat < 0:  # latency below resolution: fit the slope alone
        lat = 0.0
        inv_bw = float(np.linalg.lstsq(design[:, 1:], t_ms, rcond=None)[0][0])
    if inv_bw <= 0:  # flat curve (noise): no measurable bandwidth term
        inv_bw = 1e-12
        lat = float(np.mean(t_ms / design[:, 0]))
    return lat, inv_bw


def fit_p2p(sizes: np.ndarray, seconds: np.ndarray) -> LinkCost:
    """t(n) = latency + n / bandwidth, least squares."""
    design = np.stack([np.ones(len(sizes)), 1000.0 * sizes.astype(float)], axis=1)
    lat, inv_bw = _fit(design, 1000.0 * seconds)
    return LinkCost(latency_ms=lat, bandwidth=1.0 / inv_bw)


def fit_allreduce(sizes: np.ndarray, seconds: np.ndarray, participants: int) -> LinkCost:
    """Fit the planner's all-reduce equation (linear in latency and in 1/bandwidth): the basis
    functions are the equation itself evaluated with unit latency and with unit 1/bandwidth."""
    a = np.array([allreduce_ms(LinkCost(1.0, float("inf")), int(n), participants) for n in sizes])
    b = np.array([allreduce_ms(LinkCost(0.0, 1.0), int(n), participants) for n in sizes])
    lat, inv_bw = _fit(np.stack([a, b], axis=1), 1000.0 * seconds)
    return LinkCost(latency_ms=lat, bandwidth=1.0 / inv_bw)


def measure_links(device: torch.device, options: ProfilerOptions) -> tuple[LinkCost, LinkCost, str]:
    """(p2p, allreduce, description) measured with `options.comm_procs` local processes."""
    procs = max(2, options.comm_procs)
    use_nccl = device.type == "cuda" and torch.cuda.device_count() >= procs
    backend = "nccl" if use_nccl else "gloo"
    with tempfile.TemporaryDirectory(prefix="oobleck-comm-") as d:
        init_file = os.path.join(d, "store")
        result = os.path.join(d, "result.npz")
        ctx = tmp.get_context("spawn")
        workers = [ctx.Process(target=_comm_worker,
                               args=(r, procs, backend, init_file, options.comm_sizes,
                                     options.comm_repeats, result), daemon=True)
                   for r in range(procs)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + options.comm_timeout_s
        try:
            for w in workers:
                w.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            alive = [w for w in workers if w.is_alive()]
            for w in alive:
                w.kill()
                w.join(5)
        codes = [w.exitcode for w in workers]
        if alive or any(codes) or not os.path.exists(result):
            raise ProfileError(f"link measurement with {procs} {backend} processes failed "
                               f"(exit codes {codes}{', timed out' if alive else ''}). Fix: check "
                               f"that local processes can talk over {backend}, or raise the timeout")
        r = np.load(result)
        sizes, p2p_s, ar_s = r["sizes"], r["p2p"], r["allreduce"]
    what = ("NCCL between local GPUs" if use_nccl else
            "gloo over TCP loopback between local processes")
    return fit_p2p(sizes, p2p_s), fit_allreduce(sizes, ar_s, procs), what


# ----------------------------------------------------------------------------- core sharing


def _sharing_worker(job: JobConfig, conn) -> None:
    """One process of the core-sharing measurement: the whole model, forward + backward, in a
    loop when told to (start time, seconds); answers its mean iteration time in ms."""
    torch.set_num_threads(1)
    model = build_model(job.model, job.source)
    layers = [model.build_layer(i) for i in range(model.num_layers)]
    seq_len = job.data.seq_len or model.seq_len
    x = torch.randint(0, TOKEN_RANGE, (job.train.microbatch_size, seq_len))
    bf16 = job.model.dtype == "bfloat16"

    def once() -> None:
        h = x
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for layer in layers:
                h = layer(h)
        h.float().sum().backward()
        for layer in layers:
            layer.zero_grad(set_to_none=True)

    once()
    once()
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        start_at, seconds = msg
        time.sleep(max(0.0, start_at - time.time()))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            once()
            n += 1
        conn.send(1000.0 * (time.perf_counter() - t0) / n)


def measure_core_sharing(job: JobConfig, options: ProfilerOptions) -> tuple[float, ...]:
    """`MachineProfile.core_sharing` of this host for the job's model (see the module docstring):
    entry k-1 = mean iteration time of k x cores concurrent processes / one process alone."""
    cores = host_cores()
    levels = min(options.sharing_levels, options.sharing_max_procs // cores)
    if levels < 1:
        return ()
    ctx = tmp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(levels * cores)]
    procs = [ctx.Process(target=_sharing_worker, args=(job, child), daemon=True)
             for _, child in pipes]
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
        conns = [parent for parent, _ in pipes]
        deadline = time.monotonic() + options.comm_timeout_s

        def recv(c):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise ProfileError(f"the core-sharing measurement ({len(procs)} processes) timed "
                                   f"out. Fix: raise the timeout, or set fewer sharing levels")
            return c.recv()

        for c in conns:
            recv(c)

        def level(n: int) -> float:
            start_at = time.time() + 0.05
            for c in conns[:n]:
                c.send((start_at, options.sharing_seconds))
            return statistics.mean(recv(c) for c in conns[:n])

        alone = level(1)
        return tuple(round(level(k * cores) / alone, 4) for k in range(1, levels + 1))
    finally:
        for parent, _ in pipes:
            with contextlib.suppress(OSError):
                parent.send(None)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env

