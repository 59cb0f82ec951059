"""Measure a model's profile on this machine: per-layer compute and memory, and the links.

Layers (one at a time, in model order, at the job's microbatch size, sequence length and dtype):

- The input of layer i is the real output of layer i-1 on a random token batch (layer 0 gets the
  int64 tokens), detached and marked `requires_grad` like a pipeline stage's received activation,
  so layer i's backward also computes the gradient it would send back. The last layer's forward
  includes the loss (`model.loss(...).mean()`), and its backward starts from that scalar; the
  others back-propagate a fixed random output gradient.
- Time: `warmup` untimed iterations, then `repeats` timed ones. GPU: CUDA events around forward
  and backward (one synchronise per iteration); CPU: `time.perf_counter` (monotonic). Kept: the
  median and the interquartile range (`*_spread_ms`).
- Bytes: parameters and gradients as allocated after backward (numel x element size); optimizer
  state by creating `torch.optim.AdamW` for the layer and taking one real step (exp_avg,
  exp_avg_sq, step: unique storages); activations kept for backward by recording every tensor
  autograd saves during one forward (`torch.autograd.graph.saved_tensors_hooks`) and summing the
  sizes of their unique storages, parameters excluded (they are counted as parameters; a view of
  a storage counts the whole storage because the whole storage stays alive); output bytes = the
  layer's output tensor (what the next stage receives).
- Row counts: besides the full microbatch, forward and backward are timed on its first r rows
  for r = 1 .. microbatch_size - 1 (`forward_rows_ms`, `backward_rows_ms`): a k-GPU stage runs
  ceil(mb / k) rows per GPU, and small row counts are less efficient than a 1/k share.
- Optimizer: one step of the engine's AdamW (`engine.optim.make_optimizer`) over the layer's
  parameters, timed like the layers (`optimizer_ms`).
- On CPU the layers run with `cpu_threads` torch threads (default 1, as the engine's CPU workers).
- Core sharing (CPU only; `MachineProfile.core_sharing`): the local launcher runs every node's
  workers on one host, often more of them than it has cores. k x cores processes (k = 1 ..
  `sharing_levels`) run the whole model's forward + backward at once, for `sharing_seconds`; entry
  k-1 = their mean iteration time / the time of one process alone on the idle host.
- bfloat16 jobs run the forward under `torch.autocast(dtype=torch.bfloat16)` with float32 weights,
  exactly as the engine does.

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
  measurement, and `interconnect` says so. Device memory on CPU is the machine's memory divided
  by the worker processes per node (they share it).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.multiprocessing as tmp
from torch import nn

import oobleck_hpc
from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import ProfileError
from oobleck_hpc.models.base import LayerModel, build_model
from oobleck_hpc.profiling.profile import (
    Fingerprint,
    LayerProfile,
    LinkCost,
    MachineProfile,
    ModelProfile,
)

TOKEN_RANGE = 256  # random input tokens lie below the byte vocabulary: valid for every model


@dataclass(frozen=True)
class ProfilerOptions:
    warmup: int = 3
    """Untimed iterations per layer before measuring."""
    repeats: int = 10
    """Timed iterations per layer (median and interquartile range kept)."""
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
    """Message sizes (bytes) of the link measurements."""
    comm_repeats: int = 8
    comm_procs: int = 2
    """Processes for the link measurement (all-reduce participants); at least 2."""
    comm_timeout_s: float = 120.0
    cpu_threads: int = 1
    """Torch threads on CPU: what one CPU worker of the engine gets (the local launcher sets
    OMP_NUM_THREADS=1 so the workers of a node share its cores)."""
    sharing_levels: int = 6
    """CPU: measure `core_sharing` for 1 .. this many workers per core (0 skips it)."""
    sharing_max_procs: int = 48
    """CPU: at most this many processes for the core-sharing measurement (fewer levels on a
    host with many cores)."""
    sharing_seconds: float = 0.6
    """CPU: how long every level of the core-sharing measurement runs."""


# ----------------------------------------------------------------------------- timing helpers


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    q = np.percentile(np.asarray(xs), [25, 50, 75])
    return float(q[1]), float(q[2] - q[0])


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Run `fn()` once and sum the bytes of the unique storages autograd saves for backward,
    skipping the storages of `exclude` (the parameters). Returns (bytes, fn's output)."""
    skip = {_storage_key(p) for p in exclude}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip and key[1] != 0:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _tensor_bytes(ts) -> int:
    seen = {}
    for t in ts:
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_state_bytes(layer: nn.Module, lr: float = 1e-4) -> int:
    """Bytes of AdamW's state for `layer`, created for real by one step (gradients must be set).
    The layer's parameters are restored afterwards."""
    params = [p for p in layer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr)
    opt.step()
    nbytes = _tensor_bytes(v for state in opt.state.values() for v in state.values())
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return nbytes


def optimizer_step_ms(layer: nn.Module, device: torch.device, options: "ProfilerOptions") -> float:
    """Median time of one step of the engine's own optimizer (engine.optim.make_optimizer: fused
    AdamW where available) over `layer`'s parameters, whose gradients are set. The layer's
    parameters are restored afterwards."""
    from oobleck_hpc.config import TrainConfig
    from oobleck_hpc.engine.optim import make_optimizer

    params = [p for p in layer.parameters() if p.requires_grad and p.grad is not None]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    opt = make_optimizer([layer], TrainConfig(), device)
    times = []
    for rep in range(options.warmup + options.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rep >= options.warmup:
            times.append(1000 * (time.perf_counter() - t0))
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return _median_iqr(times)[0]


class _Timer:
    """Forward/backward timing: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fwd: Callable[[], torch.Tensor], bwd: Callable[[torch.Tensor], None]) -> tuple[float, float]:
        if self.cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            out = fwd()
            e1.record()
            bwd(out)
            e2.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1), e1.elapsed_time(e2)
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        bwd(out)
        t2 = time.perf_counter()
        return 1000 * (t1 - t0), 1000 * (t2 - t1)


# ----------------------------------------------------------------------------- layers


def profile_layers(model: LayerModel, microbatch_size: int, seq_len: int, dtype: str,
                   device: torch.device, options: ProfilerOptions,
                   progress: Callable[[int, LayerProfile], None] | None = None) -> list[LayerProfile]:
    """Measure every layer of `model` (see the module docstring)."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, TOKEN_RANGE, (microbatch_size, seq_len), generator=gen).to(device)
    targets = torch.randint(0, TOKEN_RANGE, (microbatch_size, seq_len), generator=gen).to(device)
    autocast = dtype == "bfloat16"
    names = model.layer_names()
    timer = _Timer(device)
    x: torch.Tensor = tokens
    out_layers = []
    last = model.num_layers - 1
    for i in range(model.num_layers):
        layer = model.build_layer(i, device)
        params = list(layer.parameters())
        inp = x if i == 0 else x.detach().requires_grad_(True)

        def forward(layer=layer, inp=inp, i=i) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = layer(inp)
                if i == last:
                    return model.loss(out, targets).mean()
                return out

        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(inp)
        output_bytes = y.numel() * y.element_size()
        next_x = y.float() if i != last else None
        grad_out = None if i == last else torch.randn(y.shape, generator=gen).to(device, y.dtype)

        def backward(out: torch.Tensor, grad_out=grad_out) -> None:
            out.backward(grad_out)

        def reset(inp=inp, params=params) -> None:
            for p in params:
                p.grad = None
            if inp.requires_grad:
                inp.grad = None

        def timed(fwd: Callable[[], torch.Tensor], bwd: Callable[[torch.Tensor], None],
                  clear: Callable[[], None]) -> tuple[list[float], list[float]]:
            fs, bs = [], []
            for rep in range(options.warmup + options.repeats):
                clear()
                f, b = timer.run(fwd, bwd)
                if rep >= options.warmup:
                    fs.append(f)
                    bs.append(b)
            return fs, bs

        # Fewer rows: what one GPU of a k-GPU stage runs (its ceil(mb / k) rows of every
        # microbatch; cost.layer_compute_ms). The last row count is the full microbatch.
        rows_f, rows_b = [], []
        for r in range(1, microbatch_size):
            inp_r = inp[:r] if i == 0 else inp[:r].detach().requires_grad_(True)
            tg_r, go_r = targets[:r], None if grad_out is None else grad_out[:r]

            def fwd_r(inp_r=inp_r, tg_r=tg_r) -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = layer(inp_r)
                    return model.loss(out, tg_r).mean() if i == last else out

            def clear_r(inp_r=inp_r) -> None:
                reset()
                if inp_r.requires_grad:
                    inp_r.grad = None

            fs, bs = timed(fwd_r, lambda out, go_r=go_r: out.backward(go_r), clear_r)
            rows_f.append(_median_iqr(fs)[0])
            rows_b.append(_median_iqr(bs)[0])
        fwd_ms, bwd_ms = timed(forward, backward, reset)
        # memory: parameters, gradients (as left by the last backward), optimizer state, saved tensors
        param_bytes = _tensor_bytes(params)
        grad_bytes = _tensor_bytes(p.grad for p in params if p.grad is not None)
        opt_bytes = optimizer_state_bytes(layer)
        opt_ms = optimizer_step_ms(layer, device, options)
        reset()
        act_bytes, out = saved_activation_bytes(forward, params)
        del out
        fwd_med, fwd_iqr = _median_iqr(fwd_ms)
        bwd_med, bwd_iqr = _median_iqr(bwd_ms)
        lp = LayerProfile(name=names[i], forward_ms=fwd_med, backward_ms=bwd_med,
                          param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=opt_bytes,
                          activation_bytes=act_bytes, output_bytes=output_bytes,
                          forward_spread_ms=fwd_iqr, backward_spread_ms=bwd_iqr,
                          optimizer_ms=opt_ms, forward_rows_ms=tuple(rows_f) + (fwd_med,),
                          backward_rows_ms=tuple(rows_b) + (bwd_med,))
        out_layers.append(lp)
        if progress is not None:
            progress(i, lp)
        x = next_x if next_x is not None else x
        del layer, params
    return out_layers


# ----------------------------------------------------------------------------- links


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
    from oobleck_hpc.planning.cost import allreduce_ms

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
    from oobleck_hpc.planning.cost import host_cores

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


# ----------------------------------------------------------------------------- the whole profile


def job_device(job: JobConfig) -> torch.device:
    if job.cluster.device == "cpu" or (job.cluster.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ProfileError(f"{job.source}: cluster.device is 'cuda' but no GPU is visible. Fix: run "
                           f"the profiler on a GPU node (e.g. inside `srun`) or use device: cpu")
    return torch.device("cuda", 0)


@contextlib.contextmanager
def _cpu_threads(device: torch.device, threads: int):
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _device_memory(device: torch.device, gpus_per_node: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // gpus_per_node)


def _reporter(num_layers: int):
    """tqdm bar on a terminal; one plain line per layer in batch logs."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=num_layers, desc="profiling layers", unit="layer")

        def report(i: int, lp: LayerProfile) -> None:
            bar.set_postfix_str(f"{lp.name} fwd {lp.forward_ms:.3f} ms bwd {lp.backward_ms:.3f} ms")
            bar.update(1)
            if i == num_layers - 1:
                bar.close()
        return report

    def line(i: int, lp: LayerProfile) -> None:
        print(f"layer {i + 1}/{num_layers} {lp.name}: forward {lp.forward_ms:.3f} ms "
              f"(+-{lp.forward_spread_ms:.3f}), backward {lp.backward_ms:.3f} ms "
              f"(+-{lp.backward_spread_ms:.3f}), params {lp.param_bytes} B, "
              f"activations {lp.activation_bytes} B", flush=True)
    return line


def profile_job(job: JobConfig, options: ProfilerOptions = ProfilerOptions(), quiet: bool = False
                ) -> ModelProfile:
    """Measure the job's model on this machine (layers, then links) and return the profile."""
    from oobleck_hpc.profiling import job_device_name

    device = job_device(job)
    model = build_model(job.model, job.source)
    seq_len = job.data.seq_len or model.seq_len
    report = None if quiet else _reporter(model.num_layers)
    with _cpu_threads(device, options.cpu_threads):
        layers = profile_layers(model, job.train.microbatch_size, seq_len, job.model.profile_dtype, device,
                                options, report)
    p2p, allreduce, what = measure_links(device, options)
    sharing = measure_core_sharing(job, options) if device.type == "cpu" else ()
    interconnect = (f"single machine: intra-node links = {what}; inter-node links = the same "
                    f"loopback measurement (no second node)")
    if device.type == "cpu":
        interconnect += f"; CPU workers with {options.cpu_threads} torch thread(s) each"
    gpn = job.cluster.gpus_per_node
    machine = MachineProfile(device_name=job_device_name(job), device_memory_bytes=_device_memory(device, gpn),
                             gpus_per_node=gpn, p2p_intra=p2p, p2p_inter=p2p,
                             allreduce_intra=allreduce, allreduce_inter=allreduce,
                             interconnect=interconnect, core_sharing=sharing)
    nccl = ""
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    fingerprint = Fingerprint(
        model_name=model.name, arch_hash=model.arch_hash(), microbatch_size=job.train.microbatch_size,
        dtype=job.model.profile_dtype, device_name=machine.device_name, gpus_per_node=gpn,
        interconnect=interconnect, source="measured", torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda or "", nccl_version=nccl,
        tool_version=f"oobleck_hpc {oobleck_hpc.__version__}",
        created_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return ModelProfile(fingerprint=fingerprint, machine=machine, layers=tuple(layers))


def profile_and_save(job: JobConfig, out_dir: str | Path | None = None, overwrite: bool = False,
                     options: ProfilerOptions = ProfilerOptions()) -> Path:
    """`oobleck-hpc profile`: measure, then write `<out_dir>/<model>/<device>/<dtype>-mb<k>.h5`."""
    from oobleck_hpc.profiling import job_device_name
    from oobleck_hpc.profiling.store import library_path, library_path_for, save_profile

    out = Path(out_dir or job.profile.library)
    planned = library_path_for(out, build_model(job.model, job.source).name, job_device_name(job),
                               job.model.profile_dtype, job.train.microbatch_size)
    if planned.exists() and not overwrite:  # before measuring; checked again atomically on save
        raise ProfileError(f"{planned} already exists; refusing to overwrite it. Fix: pass --force "
                           f"to replace it, or --out another directory")
    profile = profile_job(job, options)
    return save_profile(profile, library_path(out, profile.fingerprint), overwrite=overwrite)


# ----------------------------------------------------------------------------- acceptance check


@dataclass(frozen=True)
class StepTiming:
    wall_ms: float
    """Median wall-clock time of a step."""
    wall_iqr_ms: float
    cpu_ms: float
    """Median CPU time the process used per step (CPU device only; 0 on GPU). On a machine
    shared with other busy processes a step of many milliseconds is preempted, so its wall time
    measures the machine's load; with one torch thread its CPU time is the step's own cost."""


def measure_step_ms(job: JobConfig, microbatches: int, warmup: int = 3, repeats: int = 10,
                    cpu_threads: int = ProfilerOptions.cpu_threads) -> StepTiming:
    """A real single-process training step of the whole model: `microbatches` forward/backward
    passes with gradient accumulation, gradient clipping as the job sets it, one AdamW step --
    the run a 1-node, 1-stage, 1-GPU plan predicts from the profile."""
    device = job_device(job)
    model = build_model(job.model, job.source)
    layers = nn.ModuleList(model.build_layer(i, device) for i in range(model.num_layers))
    t = job.train
    opt = torch.optim.AdamW(layers.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    seq_len = job.data.seq_len or model.seq_len
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, TOKEN_RANGE, (t.microbatch_size, seq_len), generator=gen).to(device),
                torch.randint(0, TOKEN_RANGE, (t.microbatch_size, seq_len), generator=gen).to(device))
               for _ in range(microbatches)]
    autocast = job.model.dtype == "bfloat16"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                for layer in layers:
                    x = layer(x)
                loss = model.loss(x, y).mean() / microbatches
            loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(layers.parameters(), t.grad_clip)
        opt.step()

    times, cpu = [], []
    with _cpu_threads(device, cpu_threads):
        for rep in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= warmup:
                times.append(1000 * (time.perf_counter() - t0))
                cpu.append(1000 * (time.process_time() - c0))
    wall, iqr = _median_iqr(times)
    return StepTiming(wall, iqr, statistics.median(cpu) if device.type == "cpu" else 0.0)


def predicted_single_gpu_step_ms(profile: ModelProfile, microbatches: int) -> float:
    """The planner's prediction for the whole model as one stage on one GPU of one node: the
    template the planner builds for 1 node of 1 GPU (necessarily one stage), timed by its cost
    model (`planning.cost.pipeline_iteration_ms`)."""
    import dataclasses

    from oobleck_hpc.planning.cost import pipeline_iteration_ms
    from oobleck_hpc.planning.templates import build_templates

    one_gpu = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, gpus_per_node=1))
    templates = build_templates(one_gpu, [1], microbatches)
    if 1 not in templates:
        raise ProfileError("the model does not fit one device by the profile's memory figures; "
                           "a single-stage prediction does not exist")
    template = templates[1]
    assert template.num_stages == 1 and template.stages[0].gpus == (0,)
    return pipeline_iteration_ms(template, microbatches)
