"""Profiles: what the planner knows about a model on a machine.

- `profile.py`   the data model (pure, imported by the planner),
- `store.py`     the HDF5 files (the only module importing h5py),
- `library.py`   the shared library of such files: paths, listing, importing,
- `profiler.py`  measures a profile on this machine (`oobleck-hpc profile JOB.yaml`),
- `layers.py`, `links.py`, `timing.py`  its measurements: every layer; the links and core
  sharing; what both share (options, timer),
- `analytic.py`  derives one from FLOP and byte counts for machines we do not have,
- `cli.py`       `oobleck-hpc profile` and `oobleck-hpc profiles ls|show|verify|import|diff`.

`resolve_profile(job)` is how a job gets its profile, in this order:

1. `profile.path` when set (an explicit file);
2. the library: `<profile.library>/<model>/<device>/<dtype>-mb<k>.h5`, where device is
   `profile.device`, else 'cpu' for CPU jobs or the CUDA device name of this machine;
3. `analytic_profile(...)` when `profile.analytic: true` (device = `profile.device`), also when
   the library holds an analytic file made for other settings (e.g. 8 instead of 1 GPU per node);
4. otherwise a ProfileError naming the file looked for and the command that creates it.

Whatever the source, the profile is checked against the job before the planner sees it:
architecture hash, microbatch size, dtype and GPUs per node must match; a mismatch names both
values. This package's __init__ imports neither torch nor h5py (the planner imports
`profiling.profile` and must stay light); they are imported inside the functions that need them.
"""

from __future__ import annotations

from pathlib import Path

from oobleck_hpc.config import JobConfig
from oobleck_hpc.errors import ProfileError
from oobleck_hpc.profiling.profile import ModelProfile


def job_arch_hash(job: JobConfig) -> str:
    """The architecture hash of the job's model (built-in GPTs and Hugging Face configs without
    importing torch)."""
    if job.model.hf is not None:
        from oobleck_hpc.models.hf_config import hf_arch

        return hf_arch(job.model.hf, job.source).arch_hash()
    if job.model.factory is None:
        from oobleck_hpc.models.configs import GPT_CONFIGS

        if job.model.name in GPT_CONFIGS:
            return GPT_CONFIGS[job.model.name].arch_hash()
    from oobleck_hpc.models.base import build_model

    return build_model(job.model, job.source).arch_hash()


def job_device_name(job: JobConfig) -> str:
    """The device name profiles of this job are filed under."""
    if job.profile.device:
        return job.profile.device
    device = job.cluster.device
    if device == "cpu":
        return "cpu"
    import torch

    if device == "auto" and not torch.cuda.is_available():
        return "cpu"
    if not torch.cuda.is_available():
        raise ProfileError(f"{job.source}: cluster.device is 'cuda' but no GPU is visible here, so the "
                           f"profile's device name is unknown. Fix: set profile.device (e.g. "
                           f"'A100-80G' or the name under {job.profile.library}/{job.model.name}/)")
    return torch.cuda.get_device_name(0)


def library_file(job: JobConfig) -> Path:
    """The library file a job's profile is looked up in (it may not exist)."""
    from oobleck_hpc.profiling.library import library_path_for

    return library_path_for(job.profile.library, job.model.name, job_device_name(job),
                            job.model.profile_dtype, job.train.microbatch_size)


def check_profile(profile: ModelProfile, job: JobConfig, origin: str) -> ModelProfile:
    """Raise ProfileError unless `profile` describes this job's model, microbatch size, dtype and
    GPUs per node. `origin` names where the profile came from (a file or 'analytic')."""
    fp = profile.fingerprint
    expected = {
        "architecture hash (model.name / model.factory / model.hf)": (fp.arch_hash, job_arch_hash(job)),
        "microbatch size (train.microbatch_size)": (fp.microbatch_size, job.train.microbatch_size),
        "dtype (model.dtype)": (fp.dtype, job.model.profile_dtype),
        "GPUs per node (cluster.gpus_per_node)": (fp.gpus_per_node, job.cluster.gpus_per_node),
    }
    for what, (have, want) in expected.items():
        if have != want:
            raise ProfileError(
                f"profile {origin} does not match job {job.source}: {what} is {have!r} in the "
                f"profile (model {fp.model_name!r}) but {want!r} in the job. Fix: measure a "
                f"matching profile with `oobleck-hpc profile {job.source}`, or point profile.path "
                f"at one that matches")
    if profile.num_layers < 2:
        raise ProfileError(f"profile {origin} has {profile.num_layers} layers; a model needs at "
                           f"least 2. Fix: re-create it with `oobleck-hpc profile {job.source}`")
    return profile


def resolve_profile(job: JobConfig) -> ModelProfile:
    """The job's profile: explicit path, else library, else analytic (if allowed); validated.
    A job whose model.factory cannot be imported gets that error (ConfigError), not 'no
    profile': the profile is checked against the factory's model."""
    from oobleck_hpc.profiling.store import load_profile

    if job.model.factory is not None:
        from oobleck_hpc.models.factory import load_factory

        load_factory(job.model.factory, job.source)
    if job.profile.path:
        return check_profile(load_profile(job.profile.path), job, job.profile.path)
    path = library_file(job)
    if path.exists():
        profile = load_profile(path)
        try:
            return check_profile(profile, job, str(path))
        except ProfileError:
            # an analytic library file made for other settings (e.g. GPUs per node) is no reason
            # to refuse a job that allows analytic profiles: derive one for exactly this job
            if not (job.profile.analytic and profile.fingerprint.source == "analytic"):
                raise
    if job.profile.analytic:
        from oobleck_hpc.profiling.analytic import analytic_profile

        if not job.profile.device:
            raise ProfileError(f"{job.source}: profile.analytic is true but profile.device is not "
                               f"set. Fix: set profile.device to the GPU the analytic profile "
                               f"describes (A40, A100-80G or H100-80G)")
        model = job.model.name
        if job.model.hf is not None:
            from oobleck_hpc.models.hf_config import hf_arch

            model = hf_arch(job.model.hf, job.source)
        profile = analytic_profile(model, job.profile.device, job.train.microbatch_size,
                                   dtype=job.model.profile_dtype,
                                   gpus_per_node=job.cluster.gpus_per_node, name=job.model.name,
                                   seq_len=job.data.seq_len)
        return check_profile(profile, job, f"analytic({job.model.name}, {job.profile.device})")
    raise ProfileError(
        f"no profile for job {job.source}: looked for {path} (model {job.model.name!r}, device "
        f"{job_device_name(job)!r}, dtype {job.model.profile_dtype!r}, microbatch "
        f"{job.train.microbatch_size}). Fix: measure it with `oobleck-hpc profile {job.source}`, "
        f"set profile.path to an existing file, or set profile.analytic: true and profile.device")


__all__ = ["check_profile", "job_arch_hash", "job_device_name", "library_file", "resolve_profile"]
