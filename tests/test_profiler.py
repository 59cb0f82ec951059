"""Profiler (saved-tensor accounting, optimizer state, alpha-beta fits, a real gpt-tiny run),
`resolve_profile` and the `profile` / `profiles` commands."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from oobleck_hpc.cli import main as cli_main
from oobleck_hpc.config import job_from_dict
from oobleck_hpc.errors import ProfileError
from oobleck_hpc.profiling import library, profiler, resolve_profile, store
from oobleck_hpc.profiling.profile import LinkCost

REPO = Path(__file__).resolve().parents[1]


def tiny_job(tmp_path: Path, **profile) -> "JobConfig":  # noqa: F821
    return job_from_dict({
        "name": "t", "model": {"name": "gpt-tiny"},
        "train": {"microbatch_size": 2, "global_microbatches": 4},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu"},
        "profile": {"library": str(tmp_path / "lib"), **profile},
    }, source=str(tmp_path / "job.yaml"))


def test_saved_activation_bytes_match_a_hand_count():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8, requires_grad=True)
    nbytes, out = profiler.saved_activation_bytes(lambda: block(x), list(block.parameters()))
    # Linear 1 keeps its input x (3x8), GELU keeps its input (3x16), Linear 2 keeps its input
    # (3x16); the weights it also saves are parameters, not activations. float32 = 4 bytes.
    assert nbytes == 4 * (3 * 8 + 3 * 16 + 3 * 16)
    assert out.shape == (3, 4)
    # a tensor saved twice (x * x saves x for both operands) counts once
    y = torch.randn(5, 7, requires_grad=True)
    assert profiler.saved_activation_bytes(lambda: (y * y).sum(), [])[0] == 4 * 5 * 7


def test_optimizer_state_is_created_for_real():
    layer = nn.Linear(8, 16)
    layer(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in layer.parameters()]
    nbytes = profiler.optimizer_state_bytes(layer)
    pbytes = sum(p.numel() * 4 for p in layer.parameters())
    # exp_avg + exp_avg_sq per parameter, plus one small `step` tensor per parameter tensor
    assert 2 * pbytes < nbytes <= 2 * pbytes + 8 * 2
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


def test_alpha_beta_fits_recover_known_links():
    sizes = np.array([1 << 12, 1 << 16, 1 << 20, 1 << 22])
    true = LinkCost(latency_ms=0.05, bandwidth=2e9)
    secs = np.array([true.time_ms(n) / 1000 for n in sizes])
    fit = profiler.fit_p2p(sizes, secs)
    assert fit.latency_ms == pytest.approx(0.05, rel=1e-6) and fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    from oobleck_hpc.planning.cost import allreduce_ms
    ar = LinkCost(latency_ms=0.2, bandwidth=1e9)
    secs = np.array([allreduce_ms(ar, int(n), 4) / 1000 for n in sizes])
    fit = profiler.fit_allreduce(sizes, secs, 4)
    assert fit.latency_ms == pytest.approx(0.2, rel=1e-6) and fit.bandwidth == pytest.approx(1e9, rel=1e-6)


FAST = profiler.ProfilerOptions(warmup=1, repeats=3, comm_sizes=(1 << 10, 1 << 14, 1 << 18),
                                comm_repeats=3, comm_timeout_s=90, sharing_levels=2,
                                sharing_seconds=0.3)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prof")
    job = tiny_job(tmp)
    path = profiler.profile_and_save(job, options=FAST)
    return job, path


@pytest.mark.timeout(180)
def test_profiler_on_gpt_tiny_round_trips_and_verifies(measured, capsys):
    job, path = measured
    assert path == Path(job.profile.library) / "gpt-tiny" / "cpu" / "float32-mb2.h5"
    p = store.verify(path)
    fp = p.fingerprint
    assert (fp.model_name, fp.microbatch_size, fp.dtype, fp.gpus_per_node, fp.source) == (
        "gpt-tiny", 2, "float32", 2, "measured")
    assert fp.torch_version == torch.__version__ and fp.created_at.endswith("Z")
    assert "loopback" in p.machine.interconnect
    assert [x.name for x in p.layers] == ["embedding", "block0", "block1", "block2", "block3", "head"]
    d, b, t, v = 64, 2, 64, 256
    block = p.layers[1]
    assert block.param_bytes == 4 * (12 * d * d + 13 * d) and block.grad_bytes == block.param_bytes
    assert block.output_bytes == 4 * b * t * d and p.layers[-1].output_bytes == 4 * b * t * v
    assert all(x.forward_ms > 0 and x.backward_ms > 0 for x in p.layers)
    # schema 2: times at 1 .. mb rows (the last is the full microbatch) and the optimizer step
    assert fp.schema_version == 3
    assert all(len(x.forward_rows_ms) == len(x.backward_rows_ms) == b for x in p.layers)
    assert all(x.forward_rows_ms[-1] == x.forward_ms and x.backward_rows_ms[-1] == x.backward_ms
               and min(x.forward_rows_ms + x.backward_rows_ms) > 0 and x.optimizer_ms > 0
               for x in p.layers)
    assert all(x.activation_bytes >= x.output_bytes for x in p.layers[1:])
    assert p.machine.p2p_intra.bandwidth > 0 and p.machine.allreduce_intra.latency_ms >= 0
    # schema 3: core sharing at 1 and 2 workers per core; two per core take about twice as long
    one, two = p.machine.core_sharing
    assert 0.5 < one < 1.5 * two / 2 and two > 1.3 * one
    profiler._reporter(6)(5, p.layers[5])  # outside a TTY: one plain line per layer, no bar
    assert capsys.readouterr().out.startswith("layer 6/6 head: forward ")
    # the job resolves to it from the library; an explicit path works too
    assert resolve_profile(job) == p
    assert resolve_profile(tiny_job(Path(job.profile.library).parent, path=str(path))) == p


@pytest.mark.timeout(120)
def test_profiles_commands(measured, tmp_path, capsys):
    job, path = measured
    lib = str(Path(job.profile.library))
    assert cli_main(["profiles", "ls", lib]) == 0
    assert "gpt-tiny  cpu     float32  2" in capsys.readouterr().out
    assert cli_main(["profiles", "show", str(path)]) == 0
    assert "block3" in capsys.readouterr().out
    assert cli_main(["profiles", "verify", lib]) == 0
    # import into a fresh library, twice (second time: identical, skipped)
    dst = tmp_path / "dst"
    assert cli_main(["profiles", "import", lib, "--library", str(dst)]) == 0
    assert cli_main(["profiles", "import", lib, "--library", str(dst)]) == 0
    assert "identical" in capsys.readouterr().out
    copy = library.library_path(dst, store.load_profile(path).fingerprint)
    assert cli_main(["profiles", "diff", str(path), str(copy)]) == 0
    assert capsys.readouterr().out.strip().endswith("identical")
    # a damaged file makes verify fail with a non-zero exit, naming the file
    data = bytearray(copy.read_bytes())
    bad = dst / "gpt-tiny" / "cpu" / "damaged.h5"
    bad.write_bytes(bytes(data[: len(data) // 3]))
    assert cli_main(["profiles", "verify", str(dst)]) == 2
    assert f"BAD {bad}" in capsys.readouterr().out
    # `profile` refuses to overwrite an existing measurement before measuring anything
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"model: {{name: gpt-tiny}}\ncluster: {{nodes: 1, gpus_per_node: 2, device: cpu}}\n"
                        f"profile: {{library: {lib}}}\n")
    assert cli_main(["profile", str(job_file)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_resolve_profile_mismatch_and_missing(measured, tmp_path):
    job, path = measured
    other = dataclasses.replace(job, train=dataclasses.replace(job.train, microbatch_size=4))
    with pytest.raises(ProfileError, match=r"no profile for job .*looked for .*gpt-tiny/cpu/float32-mb4\.h5"
                                           r".*oobleck-hpc profile"):
        resolve_profile(other)
    forced = dataclasses.replace(other, profile=dataclasses.replace(other.profile, path=str(path)))
    with pytest.raises(ProfileError, match=r"microbatch size \(train.microbatch_size\) is 2 in the "
                                           r"profile .* but 4 in the job"):
        resolve_profile(forced)
    gpn = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_node=4))
    with pytest.raises(ProfileError, match=r"GPUs per node .* is 2 in the profile .* but 4 in the job"):
        resolve_profile(gpn)
    mini = dataclasses.replace(forced, train=job.train, model=dataclasses.replace(job.model, name="gpt-mini"))
    with pytest.raises(ProfileError, match=r"architecture hash .* in the profile \(model 'gpt-tiny'\)"):
        resolve_profile(mini)


def test_resolve_profile_analytic_fallback(tmp_path):
    job = job_from_dict({"model": {"name": "gpt3-350m", "dtype": "bfloat16"},
                         "train": {"microbatch_size": 1},
                         "cluster": {"nodes": 8, "gpus_per_node": 8, "device": "cuda"},
                         "profile": {"library": str(tmp_path), "analytic": True, "device": "A100-80G"}})
    p = resolve_profile(job)
    assert p.fingerprint.source == "analytic" and p.num_layers == 26
    no_device = dataclasses.replace(job, profile=dataclasses.replace(job.profile, device=None))
    with pytest.raises(ProfileError, match="profile.device"):
        resolve_profile(no_device)
    # the shipped library's analytic file has 8 GPUs per node; a 1-GPU job that allows analytic
    # profiles gets one derived for it, a job that does not is told about the mismatch
    one = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpus_per_node=1),
                              profile=dataclasses.replace(job.profile, library=str(REPO / "profiles")))
    assert (REPO / "profiles" / "gpt3-350m" / "A100-80G" / "bfloat16-mb1.h5").exists()
    assert resolve_profile(one).fingerprint.gpus_per_node == 1
    strict = dataclasses.replace(one, profile=dataclasses.replace(one.profile, analytic=False))
    with pytest.raises(ProfileError, match=r"GPUs per node .* is 8 in the profile .* but 1 in the job"):
        resolve_profile(strict)


def test_shipped_library_verifies_and_serves_the_demo():
    assert cli_main(["profiles", "verify", str(REPO / "profiles")]) == 0
    from oobleck_hpc.config import load_job
    job = load_job(REPO / "examples" / "gpt-tiny-local.yaml")
    job = dataclasses.replace(job, profile=dataclasses.replace(job.profile, library=str(REPO / "profiles")))
    p = resolve_profile(job)
    assert p.fingerprint.source == "measured" and p.fingerprint.device_name == "cpu"


def test_bfloat16_layers_are_measured_under_autocast():
    from oobleck_hpc.config import ModelConfig
    from oobleck_hpc.models import build_model

    model = build_model(ModelConfig(name="gpt-tiny", dtype="bfloat16"))
    opts = profiler.ProfilerOptions(warmup=0, repeats=1)
    bf = profiler.profile_layers(model, 2, 16, "bfloat16", torch.device("cpu"), opts)
    fp = profiler.profile_layers(model, 2, 16, "float32", torch.device("cpu"), opts)
    # parameters stay float32; autocast's bf16 weight copies live as long as the microbatch's
    # graph (saved for backward: counted), and the head's logits are bf16
    assert [x.param_bytes for x in bf] == [x.param_bytes for x in fp]
    assert bf[1].activation_bytes > fp[1].activation_bytes
    assert bf[-1].output_bytes == fp[-1].output_bytes // 2
    assert all(x.forward_ms > 0 for x in bf)


def test_check_step_compares_the_planner_with_a_real_step(capsys):
    """The acceptance figure's machinery (its numbers are reported, not asserted: no timed tests)."""
    from oobleck_hpc.config import load_job
    from oobleck_hpc.profiling.store import load_profile

    p = load_profile(REPO / "profiles" / "gpt-tiny" / "cpu" / "float32-mb2.h5")
    # one stage on one GPU: the planner's 1F1B time is m x (sum of forward + backward) plus one
    # optimizer step (the real step below runs it too)
    assert all(x.optimizer_ms > 0 for x in p.layers)
    assert profiler.predicted_single_gpu_step_ms(p, 4) == pytest.approx(
        4 * sum(x.forward_ms + x.backward_ms for x in p.layers)
        + sum(x.optimizer_ms for x in p.layers))
    job = load_job(REPO / "examples" / "gpt-tiny-local.yaml")
    t = profiler.measure_step_ms(job, 2, warmup=1, repeats=2)
    assert t.wall_ms > 0 and t.wall_iqr_ms >= 0 and t.cpu_ms > 0
