"""Measure a model's profile on this machine (`profile_job`, `oobleck-hpc profile JOB.yaml`) and
check it against a real training step (`measure_step_ms` vs `predicted_single_gpu_step_ms`).

The measurements, each in its own module:

- layers.py  every layer's forward, backward and optimizer time, at every row count up to the
             microbatch, and its parameter, gradient, optimizer-state, activation and output bytes;
- links.py   point-to-point and all-reduce alpha-beta fits between local processes, and (CPU)
             the core-sharing slowdown;
- timing.py  what they share: `ProfilerOptions`, the timer, median and spread, byte counts.

Device memory on CPU is the machine's memory divided by the worker processes per node (they
share it). The names of layers.py, links.py and timing.py that callers use are importable from
here too.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import oobleck_hpc
from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import ProfileError
from oobleck_hpc.models.base import build_model
from oobleck_hpc.planning.cost import pipeline_iteration_ms
from oobleck_hpc.planning.templates import build_templates
from oobleck_hpc.profiling import job_device_name
from oobleck_hpc.profiling.layers import (
    optimizer_state_bytes,
    optimizer_step_ms,
    profile_layers,
    saved_activation_bytes,
)
from oobleck_hpc.profiling.library import library_path, library_path_for
from oobleck_hpc.profiling.links import fit_allreduce, fit_p2p, measure_core_sharing, measure_links
from oobleck_hpc.profiling.profile import Fingerprint, LayerProfile, MachineProfile, ModelProfile
from oobleck_hpc.profiling.store import save_profile
from oobleck_hpc.profiling.timing import TOKEN_RANGE, ProfilerOptions, median_iqr, torch_threads

__all__ = [
    "TOKEN_RANGE", "ProfilerOptions", "StepTiming", "fit_allreduce", "fit_p2p", "job_device",
    "measure_core_sharing", "measure_links", "measure_step_ms", "optimizer_state_bytes",
    "optimizer_step_ms", "predicted_single_gpu_step_ms", "profile_and_save", "profile_job",
    "profile_layers", "saved_activation_bytes",
]


def job_device(job: JobConfig) -> torch.device:
    if job.cluster.device == "cpu" or (job.cluster.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ProfileError(f"{job.source}: cluster.device is 'cuda' but no GPU is visible. Fix: run "
                           f"the profiler on a GPU node (e.g. inside `srun`) or use device: cpu")
    return torch.device("cuda", 0)


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
    device = job_device(job)
    model = build_model(job.model, job.source)
    seq_len = job.data.seq_len or model.seq_len
    report = None if quiet else _reporter(model.num_layers)
    with torch_threads(device, options.cpu_threads):
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
    with torch_threads(device, cpu_threads):
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
    wall, iqr = median_iqr(times)
    return StepTiming(wall, iqr, statistics.median(cpu) if device.type == "cpu" else 0.0)


def predicted_single_gpu_step_ms(profile: ModelProfile, microbatches: int) -> float:
    """The planner's prediction for the whole model as one stage on one GPU of one node: the
    template the planner builds for 1 node of 1 GPU (necessarily one stage), timed by its cost
    model (`planning.cost.pipeline_iteration_ms`)."""
    one_gpu = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, gpus_per_node=1))
    templates = build_templates(one_gpu, [1], microbatches)
    if 1 not in templates:
        raise ProfileError("the model does not fit one device by the profile's memory figures; "
                           "a single-stage prediction does not exist")
    template = templates[1]
    assert template.num_stages == 1 and template.stages[0].gpus == (0,)
    return pipeline_iteration_ms(template, microbatches)
