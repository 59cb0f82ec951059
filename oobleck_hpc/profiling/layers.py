"""Measure every layer of a model on this machine: compute time and memory (`profile_layers`).

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
- On CPU the layers run with `cpu_threads` torch threads (default 1, as the engine's CPU workers;
  `profiler.profile_job` sets them).
- bfloat16 jobs run the forward under `torch.autocast(dtype=torch.bfloat16)` with float32 weights,
  exactly as the engine does.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from oobleck_hpc.config import TrainConfig
from oobleck_hpc.models.base import LayerModel
from oobleck_hpc.profiling.profile import LayerProfile
from oobleck_hpc.profiling.timing import (
    TOKEN_RANGE,
    ProfilerOptions,
    Timer,
    median_iqr,
    storage_key,
    tensor_bytes,
)


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Run `fn()` once and sum the bytes of the unique storages autograd saves for backward,
    skipping the storages of `exclude` (the parameters). Returns (bytes, fn's output)."""
    skip = {storage_key(p) for p in exclude}
    seen: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in skip and key[1] != 0:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def optimizer_state_bytes(layer: nn.Module, lr: float = 1e-4) -> int:
    """Bytes of AdamW's state for `layer`, created for real by one step (gradients must be set).
    The layer's parameters are restored afterwards."""
    params = [p for p in layer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr)
    opt.step()
    nbytes = tensor_bytes(v for state in opt.state.values() for v in state.values())
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return nbytes


def optimizer_step_ms(layer: nn.Module, device: torch.device, options: ProfilerOptions) -> float:
    """Median time of one step of the engine's own optimizer (engine.optim.make_optimizer: fused
    AdamW where available) over `layer`'s parameters, whose gradients are set. The layer's
    parameters are restored afterwards."""
    from oobleck_hpc.engine.optim import make_optimizer  # the engine package is heavy to load

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
    return median_iqr(times)[0]


def profile_layers(model: LayerModel, microbatch_size: int, seq_len: int, dtype: str,
                   device: torch.device, options: ProfilerOptions,
                   progress: Callable[[int, LayerProfile], None] | None = None) -> list[LayerProfile]:
    """Measure every layer of `model` (see the module docstring)."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, TOKEN_RANGE, (microbatch_size, seq_len), generator=gen).to(device)
    targets = torch.randint(0, TOKEN_RANGE, (microbatch_size, seq_len), generator=gen).to(device)
    autocast = dtype == "bfloat16"
    names = model.layer_names()
    timer = Timer(device)
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

            def fwd_r(inp_r=inp_r, tg_r=tg_r, layer=layer) -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = layer(inp_r)
                    return model.loss(out, tg_r).mean() if i == last else out

            def clear_r(inp_r=inp_r) -> None:
                reset()
                if inp_r.requires_grad:
                    inp_r.grad = None

            fs, bs = timed(fwd_r, lambda out, go_r=go_r: out.backward(go_r), clear_r)
            rows_f.append(median_iqr(fs)[0])
            rows_b.append(median_iqr(bs)[0])
        fwd_ms, bwd_ms = timed(forward, backward, reset)
        # memory: parameters, gradients (as left by the last backward), optimizer state, saved tensors
        param_bytes = tensor_bytes(params)
        grad_bytes = tensor_bytes(p.grad for p in params if p.grad is not None)
        opt_bytes = optimizer_state_bytes(layer)
        opt_ms = optimizer_step_ms(layer, device, options)
        reset()
        act_bytes, out = saved_activation_bytes(forward, params)
        del out
        fwd_med, fwd_iqr = median_iqr(fwd_ms)
        bwd_med, bwd_iqr = median_iqr(bwd_ms)
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

