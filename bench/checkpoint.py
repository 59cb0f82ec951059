"""Checkpoint cost: size, time training is paused per save, background write time, restore time.

    python bench/checkpoint.py --json                      # gpt-tiny and gpt-mini
    python bench/checkpoint.py --json --models gpt2-small  # 124M parameters, ~1.5 GB checkpoint

For each model: build every layer of the real GPT (oobleck_hpc.models.gpt) with an AdamW whose
state exists (one step), then save `--saves` checkpoints through `--ranks` Checkpointers (threads,
each owning an equal share of the layers, one of them the training state), as ranks would:

    blocking_s   per save, the longest time any rank's save() held its caller (the snapshot to
                 host memory; training is paused only for this). Median over saves 2..N; the
                 first save also allocates the reused host buffers (blocking_first_s)
    write_s      per save, from the save() call until the checkpoint is published (all shards
                 written + fsynced, manifest, rename, `latest`)
    restore_s    find_latest (full sha256 verification of every file) + loading every layer into
                 fresh modules and optimizers
    deferred_*   the same with save(defer_copy=True): the snapshot overlaps one forward +
                 backward of a microbatch (2 samples) and fence() waits for what is left of it;
    fwd_bwd_*    one forward + backward of a microbatch alone, while the background writer works
                 (sync snapshot), and while the deferred snapshot + writer work: what the
                 overlap costs the compute (on a CPU they share cores and memory bandwidth; on a
                 GPU the copy engine does the snapshot)
    target       blocking_s <= 10 % of write_s (target_met_deferred: with defer_copy)

`engine` (per model): the same through the real training path -- a one-rank Engine (gloo world of
one, the whole model on one stage) whose loop calls oobleck_hpc.checkpoint.resume exactly as train.py does:
`Resume.start` (restore) before the engine, `after_step` after each committed step, with a
checkpoint every 4 steps (defer_copy; the engine fences before its optimizer step):

    step_s              a training step without checkpoints (median)
    overhead_per_save_s (time of the steps with checkpoints - as many plain steps) / saves: what a
                        save really costs the loop, writer thread's competition for the cores included
    blocking_s          SaveStats.blocking_s: save() + the fence wait before optimizer.step()
    write_s             background time of one save (snapshot, files, fsyncs, publish)
    restore_s           Resume.start on a fresh process state: verify + read this rank's layers
    exact               the restored engine's first loss equals the uninterrupted one

Medians over the saves. The directory defaults to a fresh one under the system temp dir
(`--dir` to measure the filesystem that checkpoints will use).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_hpc.checkpoint import (  # noqa: E402
    Checkpointer,
    TrainState,
    capture_rng,
    find_latest,
    layer_state,
    load_layers,
    wait_published,
)
from oobleck_hpc.models.configs import GPT_CONFIGS  # noqa: E402
from oobleck_hpc.models.gpt import GPT  # noqa: E402


def build(name: str):
    model = GPT(GPT_CONFIGS[name], seed=0)
    layers = {i: model.build_layer(i) for i in range(model.num_layers)}
    opt = torch.optim.AdamW([p for m in layers.values() for p in m.parameters()], lr=1e-3)
    for m in layers.values():  # one step so that exp_avg / exp_avg_sq / step exist
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, layers, opt


def bench_model(name: str, root: Path, ranks: int, saves: int) -> dict:
    model, layers, opt = build(name)
    n = model.num_layers
    params = sum(p.numel() for m in layers.values() for p in m.parameters())
    owners = {i: i * ranks // n for i in range(n)}  # contiguous, equal shares
    cps = [Checkpointer(root, rank=r, num_layers=n, keep=2, attempt="bench") for r in range(ranks)]
    blocking, writes = [], []
    for k in range(saves):
        step = k + 1
        ts = TrainState(step=step, samples_seen=step * 32, rng=capture_rng())
        t0 = time.perf_counter()
        per_rank = [0.0] * ranks

        def save(r: int) -> None:
            shards = {i: layer_state(layers[i], opt) for i, o in owners.items() if o == r}
            s = cps[r].save(step, shards, ts if r == 0 else None)
            per_rank[r] = s.blocking_s

        threads = [threading.Thread(target=save, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not wait_published(root, step, timeout_s=600):
            raise RuntimeError(f"step {step} was not published")
        writes.append(time.perf_counter() - t0)
        blocking.append(max(per_rank))
        for cp in cps:
            cp.wait()
    ck = find_latest(root).checkpoint
    size = sum(f["size"] for f in ck.manifest["files"].values())

    # Training goes on while the writer works: one forward + backward right after save(), with
    # the snapshot taken in save() (sync) or overlapped with the forward/backward (defer_copy).
    batch = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len + 1))

    def fwd_bwd() -> float:
        t = time.perf_counter()
        x = batch[:, :-1]
        for i in range(n):
            x = layers[i](x)
        model.loss(x, batch[:, 1:]).mean().backward()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    fwd_bwd()
    alone = statistics.median(fwd_bwd() for _ in range(3))
    during = {False: [], True: []}
    deferred = []
    step = saves
    for defer in (False, True):
        for _ in range(saves):
            step += 1
            ts = TrainState(step=step, samples_seen=step * 32, rng=capture_rng())
            stats = [cps[r].save(step, {i: layer_state(layers[i], opt) for i, o in owners.items()
                                        if o == r}, ts if r == 0 else None, defer_copy=defer)
                     for r in range(ranks)]
            during[defer].append(fwd_bwd())
            for cp in cps:
                cp.fence()
            if defer:
                deferred.append(max(s.blocking_s for s in stats))
            for cp in cps:
                cp.wait()

    fresh = {i: model.build_layer(i) for i in range(n)}
    fresh_opt = torch.optim.AdamW([p for m in fresh.values() for p in m.parameters()], lr=1e-3)
    t0 = time.perf_counter()
    ck = find_latest(root).checkpoint  # verifies every file's sha256
    load_layers(ck, fresh, fresh_opt)
    ck.train_state()
    restore_s = time.perf_counter() - t0
    for i in range(n):  # the restore is exact
        for a, b in zip(layers[i].parameters(), fresh[i].parameters()):
            assert torch.equal(a, b)
    # The first save allocates the host buffers that later saves reuse: reported apart.
    warm = blocking[1:] or blocking
    b, w = statistics.median(warm), statistics.median(writes)
    return {"model": name, "params": params, "layers": n, "ranks": ranks, "saves": saves,
            "size_bytes": size, "blocking_first_s": round(blocking[0], 5),
            "blocking_s": round(b, 5), "write_s": round(w, 4),
            "blocking_fraction": round(b / w, 4),
            "deferred_blocking_s": round(statistics.median(deferred[1:] or deferred), 5),
            "deferred_blocking_fraction": round(statistics.median(deferred[1:] or deferred) / w, 4),
            "fwd_bwd_s": round(alone, 4),
            "fwd_bwd_during_write_s": round(statistics.median(during[False]), 4),
            "fwd_bwd_during_deferred_snapshot_s": round(statistics.median(during[True]), 4),
            "restore_s": round(restore_s, 4),
            "write_MBps": round(size / w / 1e6, 1), "target_blocking_le_10pct": b <= 0.10 * w,
            "target_met_deferred": statistics.median(deferred[1:] or deferred) <= 0.10 * w}


def bench_engine(name: str, root: Path, saves: int) -> dict:
    """The training path: Engine + oobleck_hpc.checkpoint.resume, one rank (see the module docstring)."""
    import datetime

    import torch.distributed as dist

    from oobleck_hpc.config import job_from_dict
    from oobleck_hpc.engine import Comm, Engine, PlanGroups
    from oobleck_hpc.engine.sampler import SyntheticTokens
    from oobleck_hpc.models.base import build_model
    from oobleck_hpc.planning import plan_job
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.checkpoint.resume import Resume

    every = 4
    warm, plain_steps = 3, 3 + 2 * saves
    steps = plain_steps + every * saves + 1
    job = job_from_dict({
        "name": f"bench-{name}", "model": {"name": name},
        "train": {"steps": steps + 1, "microbatch_size": 2, "global_microbatches": 2},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
        "fault_tolerance": {"f": 0},
        "profile": {"library": str(root / "no-profiles"), "analytic": True, "device": "A40"},
        "checkpoint": {"dir": str(root / "ckpt"), "every_steps": every, "keep": 2},
        "run_dir": str(root / "run")})
    model = build_model(job.model)
    profile = resolve_profile(job)
    _, _, plan = plan_job(job, profile, ["node0"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    dataset = SyntheticTokens(model.cfg.vocab_size, model.cfg.seq_len)

    def engine_from(ckpt: Resume, generation: int) -> tuple[Comm, Engine]:
        comm = Comm.init(store, 0, 1, generation, "gloo", 60.0)
        return comm, Engine(job, model, plan, comm, PlanGroups.build(plan, comm), dataset,
                            "cpu", state=ckpt.state, layer_states=ckpt.layer_states)

    comm = Comm.init(store, 0, 1, 0, "gloo", 60.0)
    ckpt = Resume.start(job, plan, 0, comm, "cpu", root / "run", profile)
    comm.destroy()
    comm, engine = engine_from(ckpt, 1)
    plain, losses = [], {}
    try:
        for _ in range(plain_steps):  # no checkpoints: the step alone
            t0 = time.perf_counter()
            r = engine.step()
            assert r.ok, r.error
            plain.append(time.perf_counter() - t0)
            losses[r.step] = r.loss
        while engine.state.step % every:
            losses[engine.state.step] = engine.step().loss
        t0 = time.perf_counter()
        for _ in range(every * saves):  # the loop of train.py: a save every `every` steps
            r = engine.step()
            assert r.ok, r.error
            losses[r.step] = r.loss
            ckpt.after_step(engine)
        ckpt.checkpointer.wait()
        with_saves = time.perf_counter() - t0
        last = ckpt.checkpointer.history[-1].step
        losses[engine.state.step] = engine.step().loss  # the step a restore continues with
        ckpt.finish(engine)
    finally:
        comm.destroy()
    history = ckpt.checkpointer.history
    step_s = statistics.median(plain[warm:])
    # Restore onto a fresh engine, as a requeued job does, and check the next step is exact.
    comm = Comm.init(store, 0, 1, 2, "gloo", 60.0)
    t0 = time.perf_counter()
    again = Resume.start(job, plan, 0, comm, "cpu", root / "run", profile)
    restore_s = time.perf_counter() - t0
    comm.destroy()
    comm, engine = engine_from(again, 3)
    try:
        exact = engine.state.step == last and engine.step().loss == losses.get(last)
    finally:
        comm.destroy()
    size = sum(f["size"] for f in find_latest(root / "ckpt", quarantine=False)
               .checkpoint.manifest["files"].values())
    block = statistics.median(s.blocking_s for s in history[1:] or history)
    write = statistics.median(s.write_s for s in history[1:] or history)
    return {"model": name, "size_bytes": size, "saves": len(history),
            "step_s": round(step_s, 4),
            "overhead_per_save_s": round((with_saves - every * saves * step_s) / saves, 4),
            "blocking_s": round(block, 5), "write_s": round(write, 4),
            "blocking_fraction": round(block / write, 4), "restore_s": round(restore_s, 4),
            "exact": bool(exact), "target_blocking_le_10pct": block <= 0.10 * write}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt-mini"], choices=list(GPT_CONFIGS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in args.models:
        root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")) / name
        shutil.rmtree(root, ignore_errors=True)
        try:
            results.append(bench_model(name, root, args.ranks, args.saves))
            results[-1]["engine"] = bench_engine(name, root / "engine", args.saves)
        finally:
            if args.dir is None:
                shutil.rmtree(root.parent, ignore_errors=True)
    out = {"bench": "checkpoint", "torch": torch.__version__, "machine": platform.node(),
           "cpus": torch.get_num_threads(), "results": results}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in results:
            print(f"{r['model']:>10}: {r['size_bytes'] / 1e6:8.1f} MB  blocking {r['blocking_s'] * 1e3:7.1f} ms"
                  f"  write {r['write_s'] * 1e3:8.1f} ms ({r['blocking_fraction']:.1%}; deferred "
                  f"{r['deferred_blocking_s'] * 1e3:.1f} ms, {r['deferred_blocking_fraction']:.1%})"
                  f"  restore {r['restore_s'] * 1e3:8.1f} ms")
            e = r["engine"]
            print(f"{'':>10}  engine path: step {e['step_s'] * 1e3:.1f} ms, overhead per save "
                  f"{e['overhead_per_save_s'] * 1e3:.1f} ms; blocking {e['blocking_s'] * 1e3:.2f} ms "
                  f"of write {e['write_s'] * 1e3:.1f} ms ({e['blocking_fraction']:.1%}); "
                  f"restore {e['restore_s'] * 1e3:.1f} ms; exact {e['exact']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
