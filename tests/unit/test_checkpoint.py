"""Checkpoints: ownership, the per-layer state interface, atomic publish, verification and fallback,
exact resume onto another plan, and the requeue exit path."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from oobleck_hpc.checkpoint import (
    Checkpointer,
    CheckpointError,
    StopSignals,
    TrainState,
    capture_rng,
    find_latest,
    layer_state,
    load_layer_state,
    load_layers,
    open_checkpoint,
    plan_tag,
    read_latest_pointer,
    restore_rng,
    shard_owners,
    train_state_owner,
    try_publish,
)
from oobleck_hpc.config import CheckpointConfig
from oobleck_hpc.models.configs import GPT_CONFIGS
from oobleck_hpc.models.gpt import GPT
from oobleck_hpc.planning.plan import PipelineSpec, Plan, StageSpec, Template
from oobleck_hpc.profiling.profile import Fingerprint, LayerProfile, LinkCost, MachineProfile, ModelProfile


# ----------------------------------------------------------------------------- helpers


def make_plan(pipelines: list[list[tuple[int, int]]], gpus_per_node: int = 1, generation: int = 0) -> Plan:
    """One node per stage, all GPUs of the node in the stage."""
    specs, node = [], 0
    for stages in pipelines:
        st = tuple(StageSpec(a, b, i, tuple(range(gpus_per_node))) for i, (a, b) in enumerate(stages))
        k = len(stages)
        t = Template(k, gpus_per_node, st, (1.0,) * k, (2.0,) * k, (0.1,) * (k - 1), (1,) * k)
        specs.append(PipelineSpec(t, tuple(f"n{node + i}" for i in range(k)), 4))
        node += k
    return Plan(tuple(specs), 4 * len(specs), 10.0, generation)


def make_profile(state_bytes: list[int]) -> ModelProfile:
    link = LinkCost(0.01, 1e9)
    machine = MachineProfile("cpu", 1 << 30, 1, link, link, link, link)
    fp = Fingerprint("m", "h", 1, "float32", "cpu", 1, "loopback")
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, b // 3, b // 3, b - b // 3, 0, 0)
                   for i, b in enumerate(state_bytes))
    return ModelProfile(fp, machine, layers)


def small_layers(n: int = 3, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(n)]


def step_once(layers, opt, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    for m in layers:
        x = m(x)
    x.square().mean().backward()
    opt.step()
    opt.zero_grad()


def save_all(root, num_layers, step, shards_by_rank, train_state, tag="t", keep=3):
    """Every rank's Checkpointer saves its part (threads, like ranks on one node)."""
    cps = {r: Checkpointer(root, rank=r, num_layers=num_layers, keep=keep, attempt="a")
           for r in shards_by_rank}
    for r, shards in shards_by_rank.items():
        cps[r].save(step, shards, train_state if r == 0 else None, tag=tag)
    for cp in cps.values():
        cp.wait()
    return cps


# ----------------------------------------------------------------------------- ownership


def test_shard_owners_hold_their_layer_and_are_deterministic():
    plan = make_plan([[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], gpus_per_node=2)
    owners = shard_owners(plan)
    assert sorted(owners) == list(range(6))
    for layer, rank in owners.items():
        assert rank in plan.layer_owners(layer)
    assert shard_owners(plan) == owners
    assert train_state_owner(plan) == 0


def test_shard_owners_balance_bytes_across_nodes():
    # Two replicas of everything (pipelines of 1 and 2 nodes): 3 nodes share the writes.
    plan = make_plan([[(0, 8)], [(0, 4), (4, 8)]])
    sizes = [100, 10, 10, 10, 10, 10, 10, 100]
    owners = shard_owners(plan, make_profile(sizes))
    per_node: dict[str, int] = {}
    for layer, rank in owners.items():
        node = plan.ranks[rank].node
        per_node[node] = per_node.get(node, 0) + sizes[layer]
    # 260 bytes over 3 nodes: no node writes more than one big layer plus a share of the small.
    assert max(per_node.values()) <= 130, per_node
    assert len(per_node) == 3
    with pytest.raises(CheckpointError, match="profile has 3 layers"):
        shard_owners(plan, make_profile([1, 2, 3]))


# ----------------------------------------------------------------------------- layer state


@pytest.mark.parametrize("fused", [False, True])  # the engine uses the fused AdamW where it can
def test_layer_state_round_trip_with_adamw(fused):
    layers = small_layers(2)
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-2, fused=fused)
    step_once(layers, opt)
    state = layer_state(layers[1], opt)
    assert {"param/0.weight", "optim/0.weight/exp_avg", "optim/0.weight/exp_avg_sq",
            "optim/0.weight/step", "param/1.bias"} <= set(state)

    fresh = small_layers(2, seed=5)
    opt2 = torch.optim.AdamW([p for m in fresh for p in m.parameters()], lr=1e-2, fused=fused)
    for i in range(2):
        load_layer_state(fresh[i], opt2, layer_state(layers[i], opt), layer=i)
    step_once(layers, opt, seed=2)
    step_once(fresh, opt2, seed=2)
    for a, b in zip(layers, fresh):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_load_layer_state_is_strict():
    layers = small_layers(1)
    state = layer_state(layers[0])
    with pytest.raises(CheckpointError, match="no 'param/0.bias'"):
        load_layer_state(layers[0], None, {k: v for k, v in state.items() if k != "param/0.bias"}, layer=3)
    bad = dict(state)
    bad["param/0.weight"] = torch.zeros(8, 9)
    with pytest.raises(CheckpointError, match=r"shape \(8, 9\) in the checkpoint but \(8, 8\)"):
        load_layer_state(layers[0], None, bad, layer=3)
    with pytest.raises(CheckpointError, match="does not have"):
        load_layer_state(layers[0], None, {**state, "param/extra": torch.zeros(1)})


def test_rng_capture_restores_every_generator():
    import random

    import numpy as np

    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------- save, publish, load


def _ts(step, **kw):
    return TrainState(step=step, samples_seen=step * 8, lr_schedule={"last": step},
                      rng={"torch": torch.get_rng_state()}, generation=1, extra=kw)


def test_save_publishes_only_when_every_layer_is_written(tmp_path):
    layers = small_layers(3)
    a = Checkpointer(tmp_path, rank=0, num_layers=3, attempt="x")
    b = Checkpointer(tmp_path, rank=1, num_layers=3, attempt="x")
    a.save(5, {0: layer_state(layers[0]), 1: layer_state(layers[1])}, _ts(5), tag="p")
    a.wait()
    assert find_latest(tmp_path).checkpoint is None  # layer 2 missing: nothing published
    assert read_latest_pointer(tmp_path) is None
    b.save(5, {2: layer_state(layers[2])}, None, tag="p")
    b.wait()
    ck = find_latest(tmp_path).checkpoint
    assert ck is not None and ck.step == 5 and read_latest_pointer(tmp_path) == 5
    assert ck.manifest["writers"] == [0, 1]
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    ts = ck.train_state()
    assert ts.samples_seen == 40 and ts.lr_schedule == {"last": 5} and ts.generation == 1
    assert torch.equal(ts.rng["torch"], torch.get_rng_state())
    for i in range(3):
        torch.testing.assert_close(ck.layer(i)["param/0.weight"], layers[i][0].weight.detach())


def test_snapshot_is_taken_at_save_time(tmp_path):
    """Training may change the tensors as soon as save() returns: the checkpoint has the old values."""
    layers = small_layers(1)
    before = layers[0][0].weight.detach().clone()
    cp = Checkpointer(tmp_path, rank=0, num_layers=1)
    cp.save(1, {0: layer_state(layers[0])}, _ts(1))
    with torch.no_grad():
        layers[0][0].weight.add_(1.0)
    cp.wait()
    assert torch.equal(find_latest(tmp_path).checkpoint.layer(0)["param/0.weight"], before)
    assert cp.history[-1].bytes > 0 and cp.history[-1].published


def test_deferred_snapshot_holds_the_state_of_the_save_call(tmp_path):
    """defer_copy: the copy overlaps the next forward/backward; fence() before the state changes."""
    layers = small_layers(2)
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-2)
    step_once(layers, opt)
    expect = {i: {k: v.clone() for k, v in layer_state(m, opt).items()} for i, m in enumerate(layers)}
    cp = Checkpointer(tmp_path, rank=0, num_layers=2)
    stats = cp.save(1, {i: layer_state(m, opt) for i, m in enumerate(layers)}, _ts(1), defer_copy=True)
    x = torch.randn(4, 8)
    for m in layers:  # a forward and backward only read the saved state
        x = m(x)
    x.sum().backward()
    cp.fence()
    opt.step()  # now the state may change
    cp.wait()
    ck = find_latest(tmp_path).checkpoint
    for i in range(2):
        got = ck.layer(i)
        assert got.keys() == expect[i].keys()
        for k in got:
            assert torch.equal(got[k], expect[i][k]), (i, k)
    assert cp.history[-1] is stats and stats.blocking_s > 0 and stats.published
    cp.fence()  # no deferred snapshot pending: a no-op


def test_keep_prunes_old_checkpoints_and_latest_moves_forward(tmp_path):
    layers = small_layers(2)
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=2, every_steps=2), rank=0, num_layers=2)
    saved = []
    for step in range(1, 8):
        if cp.due(step):
            cp.save(step, {i: layer_state(m) for i, m in enumerate(layers)}, _ts(step))
            saved.append(step)
    cp.wait()
    assert saved == [2, 4, 6] and not cp.due(6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-4", "step-6"]
    assert read_latest_pointer(tmp_path) == 6
    assert cp.save(6, {0: layer_state(layers[0])}) is None  # the same step twice: skipped
    # ... unless under another plan (a reconfiguration between the two saves).
    assert cp.save_sync(6, {i: layer_state(m) for i, m in enumerate(layers)}, _ts(6), tag="g1") is not None


def test_due_by_minutes_counts_from_the_last_save(tmp_path):
    cp = Checkpointer(tmp_path, rank=0, num_layers=1, every_minutes=2.0)
    t0 = cp._last_time
    assert not cp.due(1, now=t0 + 119) and cp.due(1, now=t0 + 121)
    cp.save_sync(1, {0: {"param/w": torch.zeros(1)}}, _ts(1))
    assert not cp.due(2, now=cp._last_time + 60) and cp.due(2, now=cp._last_time + 121)
    with pytest.raises(CheckpointError, match="checkpoint.dir is not set"):
        Checkpointer(CheckpointConfig(), rank=0, num_layers=1)


def test_corrupt_or_partial_latest_falls_back_to_previous(tmp_path):
    layers = small_layers(2)
    cp = Checkpointer(tmp_path, rank=0, num_layers=2, keep=5)
    for step in (1, 2, 3):
        cp.save_sync(step, {i: layer_state(m) for i, m in enumerate(layers)}, _ts(step))
    # step 3: flip one byte in a shard; step 2: truncate a file.
    f3 = tmp_path / "step-3" / "layer-00001.bin"
    data = bytearray(f3.read_bytes())
    data[-1] ^= 0xFF
    f3.write_bytes(bytes(data))
    f2 = tmp_path / "step-2" / "train.bin"
    f2.write_bytes(f2.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="layer-00001.bin: sha256 differs"):
        open_checkpoint(tmp_path, 3)
    res = find_latest(tmp_path, quarantine=False)
    assert res.checkpoint.step == 1
    assert len(res.skipped) == 2 and "layer-00001.bin" in res.skipped[0] and "train.bin" in res.skipped[1]
    # Reading a layer verifies its checksum even without a full verify.
    with pytest.raises(CheckpointError, match="differs from the manifest"):
        open_checkpoint(tmp_path, 3, verify=False).layer(1)
    # Quarantine: refused checkpoints stop counting; the next save publishes and moves latest back.
    assert (tmp_path / "step-3").exists()
    assert find_latest(tmp_path).checkpoint.step == 1  # quarantines by default
    assert [p.name for p in tmp_path.glob("step-*") if p.name.startswith("step-3.refused")]
    assert not (tmp_path / "step-3").exists()
    cp2 = Checkpointer(tmp_path, rank=0, num_layers=2, keep=5, attempt="resumed")
    cp2.save_sync(2, {i: layer_state(m) for i, m in enumerate(layers)}, _ts(2))
    assert read_latest_pointer(tmp_path) == 2 and find_latest(tmp_path).checkpoint.step == 2
    (tmp_path / "step-2" / "layer-00000.bin").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        open_checkpoint(tmp_path, 2)


def test_leftovers_of_another_attempt_are_never_mixed_in(tmp_path):
    """A crashed run left step 4 half written under another plan; the new run's step 4 is clean."""
    layers = small_layers(2)
    old = Checkpointer(tmp_path, rank=1, num_layers=2, attempt="run1")
    old.save_sync(4, {1: {"param/0.weight": torch.full((8, 8), 7.0)}}, None, tag="g0")
    new = Checkpointer(tmp_path, rank=0, num_layers=2, attempt="run2")
    new.save_sync(4, {i: layer_state(m) for i, m in enumerate(layers)}, _ts(4), tag="g3")
    ck = find_latest(tmp_path).checkpoint
    assert ck.manifest["writers"] == [0]
    torch.testing.assert_close(ck.layer(1)["param/0.weight"], layers[1][0].weight.detach())
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # stale one pruned


def test_concurrent_publishers_agree(tmp_path):
    """Eight ranks finish at the same moment: exactly one rename wins, the checkpoint is whole."""
    n = 8
    layers = small_layers(n)
    for trial in range(5):
        cps = [Checkpointer(tmp_path, rank=r, num_layers=n, attempt="c", keep=2) for r in range(n)]
        barrier = threading.Barrier(n)

        def go(r, step=trial + 1):
            barrier.wait()
            cps[r].save_sync(step, {r: layer_state(layers[r])}, _ts(step) if r == 0 else None)

        threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(cp.history[-1].published for cp in cps) == 1
        ck = open_checkpoint(tmp_path, trial + 1)
        assert ck.manifest["writers"] == list(range(n))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-4", "step-5"]


def test_try_publish_finishes_a_checkpoint_whose_writers_died_before_publishing(tmp_path):
    layers = small_layers(1)
    cp = Checkpointer(tmp_path, rank=0, num_layers=1, attempt="z")
    cp.save_sync(3, {0: layer_state(layers[0])}, _ts(3))
    (tmp_path / "step-3" / "MANIFEST.json").unlink()
    os.rename(tmp_path / "step-3", tmp_path / "step-3.tmp.z._")
    (tmp_path / "latest").unlink()
    assert find_latest(tmp_path).checkpoint is None
    assert try_publish(tmp_path / "step-3.tmp.z._")
    assert find_latest(tmp_path).checkpoint.step == 3


def test_writer_errors_surface_at_wait(tmp_path):
    cp = Checkpointer(tmp_path, rank=0, num_layers=2)
    with pytest.raises(CheckpointError, match="layer 5 is not a layer"):
        cp.save(1, {5: {}})
    blocker = tmp_path / "step-1.tmp.0._"
    blocker.write_text("a file where the directory should go")
    cp.save(1, {0: {"param/w": torch.zeros(2)}}, None)
    with pytest.raises(CheckpointError, match="writing a checkpoint failed"):
        cp.wait()


# ----------------------------------------------------------------------------- exact resume


def _batch(step: int, cfg) -> torch.Tensor:
    # Data order from the global torch RNG: exact resume needs the RNG state restored.
    return torch.randint(0, cfg.vocab_size, (4, cfg.seq_len // 4 + 1))


def _lr(step: int) -> float:
    return 3e-3 * min(1.0, (step + 1) / 3) * (0.5 + 0.5 * math.cos(math.pi * step / 20))


class Stages:
    """A model split into stages, one AdamW per stage (as ranks of one pipeline hold it)."""

    def __init__(self, model: GPT, stages: list[tuple[int, int]], seed_offset: int = 0):
        self.model = model
        self.layers = {i: model.build_layer(i) for i in range(model.num_layers)}
        if seed_offset:  # start from other weights: the checkpoint must overwrite everything
            for m in self.layers.values():
                for p in m.parameters():
                    p.data.normal_()
        self.opts = {}
        for a, b in stages:
            opt = torch.optim.AdamW([p for i in range(a, b) for p in self.layers[i].parameters()],
                                    lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
            for i in range(a, b):
                self.opts[i] = opt
        self.step = 0

    def train_step(self) -> float:
        for opt in set(self.opts.values()):
            for g in opt.param_groups:
                g["lr"] = _lr(self.step)
        batch = _batch(self.step, self.model.cfg)
        x = batch[:, :-1]
        for i in range(self.model.num_layers):
            x = self.layers[i](x)
        loss = self.model.loss(x, batch[:, 1:]).mean()
        loss.backward()
        for opt in set(self.opts.values()):
            opt.step()
            opt.zero_grad()
        self.step += 1
        return loss.item()


@pytest.mark.timeout(120)
def test_exact_resume_onto_another_plan(tmp_path):
    model = GPT(GPT_CONFIGS["gpt-tiny"], seed=3)
    L, K = model.num_layers, 4
    torch.manual_seed(11)
    ref = Stages(model, [(0, L)])
    ref_losses = [ref.train_step() for _ in range(2 * K)]

    # Run A: plan of 2 pipelines (4 ranks); each rank writes the layers it owns.
    plan_a = make_plan([[(0, 3), (3, L)], [(0, 2), (2, L)]])
    torch.manual_seed(11)
    run_a = Stages(model, [(0, 3), (3, L)])
    losses_a = [run_a.train_step() for _ in range(K)]
    owners = shard_owners(plan_a)
    assert len(set(owners.values())) > 1  # the writes are shared
    ts = TrainState(step=K, samples_seen=4 * K, rng=capture_rng(), plan=plan_a.to_dict(),
                    plan_digest=plan_a.digest(), generation=plan_a.generation)
    shards = {r: {i: layer_state(run_a.layers[i], run_a.opts[i]) for i, o in owners.items() if o == r}
              for r in range(plan_a.world_size)}
    shards = {r: s for r, s in shards.items() if s or r == train_state_owner(plan_a)}
    save_all(tmp_path, L, K, shards, ts, tag=plan_tag(plan_a))
    del run_a
    torch.manual_seed(999)  # the crash loses the RNG state too

    # Run B: another plan (3 + 2 stages, 5 ranks). Every rank loads the layers it holds now.
    plan_b = make_plan([[(0, 1), (1, 4), (4, L)], [(0, 2), (2, L)]], generation=7)
    ck = find_latest(tmp_path).checkpoint
    assert ck.step == K
    per_rank = {}
    for info in plan_b.ranks:
        st = Stages(model, [(info.layer_start, info.layer_end)], seed_offset=1)
        load_layers(ck, {i: st.layers[i] for i in range(info.layer_start, info.layer_end)}, st.opts)
        per_rank[info.rank] = st
    # Replicas loaded from different writers are identical.
    for layer in range(L):
        states = [layer_state(per_rank[r].layers[layer], per_rank[r].opts[layer])
                  for r in plan_b.layer_owners(layer)]
        for s in states[1:]:
            assert s.keys() == states[0].keys()
            for k in s:
                assert torch.equal(s[k], states[0][k]), (layer, k)

    # Continue on pipeline 0 of plan B (3 stages, 3 optimizers) with the restored train state.
    resumed = Stages(model, [(0, 1), (1, 4), (4, L)], seed_offset=1)
    for info in plan_b.ranks[:3]:
        for i in range(info.layer_start, info.layer_end):
            load_layer_state(resumed.layers[i], resumed.opts[i],
                             layer_state(per_rank[info.rank].layers[i], per_rank[info.rank].opts[i]))
    state = ck.train_state()
    restore_rng(state.rng)
    resumed.step = state.step
    losses_b = [resumed.train_step() for _ in range(K)]

    got = losses_a + losses_b
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= 1e-5, (got, ref_losses)
    for i in range(L):
        for pa, pb in zip(ref.layers[i].parameters(), resumed.layers[i].parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- requeue exit path


def test_stop_signals_only_set_a_flag():
    stop = StopSignals.install()
    try:
        assert not stop
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop and stop.reason == "received SIGUSR2" and stop.signum == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "received SIGUSR2"  # the first request wins
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_manifest_is_plain_json(tmp_path):
    cp = Checkpointer(tmp_path, rank=0, num_layers=1)
    cp.save_sync(1, {0: {"param/w": torch.arange(3.0), "optim/w/step": torch.tensor(2.0)}}, _ts(1))
    m = json.loads((Path(tmp_path) / "step-1" / "MANIFEST.json").read_text())
    assert m["layers"] == {"0": "layer-00000.bin"} and m["train"] == "train.bin"
    assert set(m["files"]) == {"layer-00000.bin", "train.bin"}
    got = open_checkpoint(tmp_path, 1).layer(0)
    assert torch.equal(got["param/w"], torch.arange(3.0)) and got["optim/w/step"].shape == ()


def test_shard_files_keep_every_dtype_and_shape(tmp_path):
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.tensor([True, False, True]),
               "c": torch.arange(7, dtype=torch.int64).reshape(7, 1), "d": torch.empty(0, 4),
               "e": torch.tensor(3.5, dtype=torch.float64), "f": torch.randn(4, 6).t(),  # not contiguous
               "g": torch.randn(2, 3, dtype=torch.float16)}
    cp = Checkpointer(tmp_path, rank=0, num_layers=1)
    cp.save_sync(1, {0: tensors}, _ts(1))
    got = open_checkpoint(tmp_path, 1).layer(0)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_a_writer_whose_directory_another_writer_published_under_it_reports_nothing(
        tmp_path, monkeypatch):
    """Rank 0's completion record is the last one: rank 1 sees every record and publishes the
    directory between rank 0's rename of its record and rank 0's fsync of the directory that
    held it (FileNotFoundError). The checkpoint is whole and published: rank 0 reports no
    error (seen under a CPU hog: rank 0 skipped its next save, 'checkpoint of step 105 failed:
    ... No such file or directory: step-102.tmp...')."""
    import oobleck_hpc.files as files

    layers = small_layers(2)
    cps = [Checkpointer(tmp_path, rank=r, num_layers=2, attempt="r") for r in range(2)]
    cps[1].save_sync(3, {1: layer_state(layers[1])})
    real, raced = files.fsync_dir, []

    def fsync_dir(path, best_effort=False):
        path = Path(path)
        if not raced and (path / "done-rank00000.json").exists():
            raced.append(path)
            assert try_publish(path)  # rank 1's publish, in between
        real(path, best_effort)

    monkeypatch.setattr(files, "fsync_dir", fsync_dir)
    cps[0].save(3, {0: layer_state(layers[0])}, _ts(3))
    cps[0].wait()  # no CheckpointError
    assert raced and not raced[0].exists()
    assert not cps[0].history[-1].published
    ck = open_checkpoint(tmp_path, 3)
    assert ck.manifest["writers"] == [0, 1] and find_latest(tmp_path).checkpoint.step == 3


def test_a_joiner_and_a_survivor_built_with_the_same_rank_both_land_in_the_checkpoint(tmp_path):
    """A process's rank changes when the job reconfigures; a node that joins takes its rank in
    the new plan. Here a survivor that started as rank 1 is rank 0 of the new plan (node0 was
    lost) and a node that joined is its rank 1: each writes its part of the next checkpoint
    under its rank in that plan (`Resume._save`), and the checkpoint is published. (Named by
    the ranks they were built with, both records were done-rank00001.json, one replaced the
    other, and no checkpoint was published again after a crashed node rejoined: seen in
    bench/recovery.py crash_under_hog.)"""
    from types import SimpleNamespace

    from oobleck_hpc.checkpoint.resume import Resume
    from oobleck_hpc.config import job_from_dict

    job = job_from_dict({"name": "rejoined", "model": {"name": "gpt-tiny"},
                         "train": {"steps": 9, "microbatch_size": 2, "global_microbatches": 4},
                         "cluster": {"launch": "local", "nodes": 2, "gpus_per_node": 1},
                         "checkpoint": {"dir": str(tmp_path), "every_steps": 3}})
    plan = make_plan([[(0, 2)], [(0, 2)]], generation=2)  # two 1-node replicas of 2 layers
    assert shard_owners(plan) == {0: 0, 1: 1}
    layers = small_layers(2)
    for built_as, now in ((1, 0), (1, 1)):  # the survivor, the joiner
        cp = Checkpointer(job.checkpoint, rank=built_as, num_layers=2, attempt="a")
        resume = Resume(job, built_as, tmp_path / "run", "cpu", cp, StopSignals())
        engine = SimpleNamespace(plan=plan, comm=SimpleNamespace(rank=now),
                                 state=SimpleNamespace(step=6, cursor=48),
                                 layer_state=lambda i: layer_state(layers[i]))
        resume._save(engine, sync=True)
    ck = find_latest(tmp_path).checkpoint
    assert ck is not None and ck.step == 6, sorted(p.name for p in tmp_path.iterdir())
    assert ck.manifest["writers"] == [0, 1]
