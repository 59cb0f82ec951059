"""What one stage-to-stage message costs between two processes that both compute, on this host.

    python bench/exchange.py [--json] [--job examples/gpt-tiny-local.yaml] [--iterations 300]

Two processes (one torch thread each) run the first half of the job's model, forward and
backward on one microbatch, `--iterations` times, three ways in the same processes:
- "compute": nothing else (the baseline, measured in this run);
- "gloo": after every iteration each sends the other one activation-sized message and waits for
  the other's (isend / irecv over gloo, as the engine's stages do);
- "pipe": the same message over a multiprocessing Pipe.
Keys of --json: per way the mean iteration time in ms (`compute_ms`, `gloo_ms`, `pipe_ms`), the
message cost `gloo_extra_ms` / `pipe_extra_ms` (iteration minus compute), `message_bytes`,
the idle-host p2p latency the profile charges (`profile_p2p_latency_ms`), and load_average.
planning/cost.py quotes these figures for what its shared-core model leaves out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_hpc.config import load_job  # noqa: E402


def worker(rank: int, job, port: int, iterations: int, conn, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from oobleck_hpc.models.base import build_model

    torch.set_num_threads(1)
    model = build_model(job.model)
    half = [model.build_layer(i) for i in range(model.num_layers // 2)]
    tokens = torch.randint(0, 256, (job.train.microbatch_size, model.seq_len))
    shape, _ = model.layer_output_shape(len(half) - 1, job.train.microbatch_size, model.seq_len)
    send, recv = torch.zeros(shape), torch.zeros(shape)
    raw = bytes(send.numel() * send.element_size())
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)

    def compute() -> None:
        h = tokens
        for layer in half:
            h = layer(h)
        h.sum().backward()

    def gloo() -> None:
        s = dist.isend(send, 1 - rank)
        dist.irecv(recv, 1 - rank).wait()
        s.wait()

    def pipe() -> None:
        conn.send_bytes(raw)
        conn.recv_bytes()

    result = {"message_bytes": len(raw)}
    for way, exchange in (("compute", None), ("gloo", gloo), ("pipe", pipe)):
        for _ in range(5):
            compute()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            compute()
            if exchange is not None:
                exchange()
        result[f"{way}_ms"] = 1000.0 * (time.perf_counter() - t0) / iterations
    dist.destroy_process_group()
    out.put((rank, result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="examples/gpt-tiny-local.yaml")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    job = load_job(args.job)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, job, args.port, args.iterations, c, out))
             for r, c in enumerate((a, b))]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=600)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0] if k.endswith("_ms")}
    from oobleck_hpc.profiling import resolve_profile

    summary = {"message_bytes": results[0]["message_bytes"],
               **{k: round(v, 3) for k, v in mean.items()},
               "gloo_extra_ms": round(mean["gloo_ms"] - mean["compute_ms"], 3),
               "pipe_extra_ms": round(mean["pipe_ms"] - mean["compute_ms"], 3),
               "profile_p2p_latency_ms": round(resolve_profile(job).machine.p2p_inter.latency_ms, 4),
               "load_average": list(os.getloadavg())}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"compute {summary['compute_ms']:.2f} ms per iteration; with a "
              f"{summary['message_bytes']} B exchange: gloo +{summary['gloo_extra_ms']:.2f} ms, "
              f"pipe +{summary['pipe_extra_ms']:.2f} ms (the profile charges "
              f"{summary['profile_p2p_latency_ms']:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
