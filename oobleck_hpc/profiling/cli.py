"""`oobleck-hpc profile JOB.yaml` and `oobleck-hpc profiles ls|show|verify|import|diff`.

    oobleck-hpc profile JOB.yaml [--out DIR] [--force] [--repeats N] [--warmup N]
        measure the job's model on this machine; writes <DIR>/<model>/<device>/<dtype>-mb<k>.h5
        (DIR defaults to the job's profile.library)
    oobleck-hpc profiles ls [DIR]                 model, device, dtype, microbatch, source, date
    oobleck-hpc profiles show FILE                one profile as a table
    oobleck-hpc profiles verify [DIR|FILE ...]    schema + checksum of every file; exit 2 if any is bad
    oobleck-hpc profiles import SRC [--library DIR] [--keep-both]
        copy another library's profiles in; never overwrites a different file (exit 2 if refused)
    oobleck-hpc profiles diff A B                 layer by layer differences
    oobleck-hpc profiles analytic [--models ..] [--devices ..] [--microbatch K ..] [--library DIR]
        write analytic profiles (how the GPT-3 family files in profiles/ are made)
    oobleck-hpc profiles check-step JOB.yaml      the planner's predicted step time for the whole
        model on one GPU vs a measured single-process training step (the profile's acceptance check)

Heavy modules (torch, h5py) are imported inside the commands, not here.
"""

from __future__ import annotations

import argparse

DEFAULT_LIBRARY = "profiles"
ANALYTIC_MODELS = ("gpt3-350m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")
ANALYTIC_DEVICES = ("A40", "A100-80G", "H100-80G")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure a job's model on this machine into the profile library")
    p.add_argument("job", help="YAML job file")
    p.add_argument("--out", default=None, help="library directory to write to (default: the job's profile.library)")
    p.add_argument("--force", action="store_true", help="replace an existing profile file")
    p.add_argument("--repeats", type=int, default=20, help="timed iterations per layer (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per layer (default 5)")
    p.set_defaults(func=_profile)

    p = sub.add_parser("profiles", help="list, show, verify, import and compare HDF5 profiles")
    ps = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = ps.add_parser("ls", help="list a library")
    q.add_argument("library", nargs="?", default=DEFAULT_LIBRARY)
    q.set_defaults(func=_ls)
    q = ps.add_parser("show", help="print one profile as a table")
    q.add_argument("file")
    q.set_defaults(func=_show)
    q = ps.add_parser("verify", help="check schema and checksum of every profile file")
    q.add_argument("paths", nargs="*", default=[DEFAULT_LIBRARY])
    q.set_defaults(func=_verify)
    q = ps.add_parser("import", help="copy profiles from another library")
    q.add_argument("src", help="a profile file or a library directory")
    q.add_argument("--library", default=DEFAULT_LIBRARY, help="destination library (default: profiles)")
    q.add_argument("--keep-both", action="store_true",
                   help="when a different profile has the same name, store the new one beside it")
    q.set_defaults(func=_import)
    q = ps.add_parser("diff", help="compare two profiles layer by layer")
    q.add_argument("a")
    q.add_argument("b")
    q.set_defaults(func=_diff)
    q = ps.add_parser("analytic", help="write analytic profiles (FLOP/byte counts) into a library")
    q.add_argument("--models", nargs="+", default=list(ANALYTIC_MODELS))
    q.add_argument("--devices", nargs="+", default=list(ANALYTIC_DEVICES))
    q.add_argument("--microbatch", type=int, nargs="+", default=[1])
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    q.add_argument("--gpus-per-node", type=int, default=8)
    q.add_argument("--library", default=DEFAULT_LIBRARY)
    q.add_argument("--force", action="store_true", help="replace existing files")
    q.set_defaults(func=_analytic)
    q = ps.add_parser("check-step", help="planner's predicted 1-GPU step time vs a measured "
                                         "single-process training step")
    q.add_argument("job", help="YAML job file (its profile is resolved as `plan` does)")
    q.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: train.global_microbatches)")
    q.add_argument("--repeats", type=int, default=10)
    q.set_defaults(func=_check_step)


def _profile(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.profiling.profiler import ProfilerOptions, profile_and_save

    job = load_job(args.job)
    options = ProfilerOptions(warmup=args.warmup, repeats=args.repeats,
                              comm_procs=max(2, job.cluster.gpus_per_node))
    path = profile_and_save(job, args.out, overwrite=args.force, options=options)
    print(f"wrote {path}")
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _ls(args: argparse.Namespace) -> int:
    from oobleck_hpc.profiling.library import list_library

    entries = list_library(args.library)
    rows = [("model", "device", "dtype", "mb", "gpn", "layers", "source", "created", "file")]
    bad = []
    for e in entries:
        if e.profile is None:
            bad.append(e)
            continue
        fp = e.profile.fingerprint
        rows.append((fp.model_name, fp.device_name, fp.dtype, str(fp.microbatch_size),
                     str(fp.gpus_per_node), str(e.profile.num_layers), fp.source, fp.created_at,
                     str(e.path)))
    _table(rows)
    for e in bad:
        print(f"BAD {e.path}: {e.error}")
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _show(args: argparse.Namespace) -> int:
    from oobleck_hpc.profiling.store import load_profile

    p = load_profile(args.file)
    fp, m = p.fingerprint, p.machine
    print(f"{args.file}")
    for k, v in vars(fp).items():
        print(f"  {k}: {v}")
    print(f"  device memory: {_fmt_bytes(m.device_memory_bytes)}, GPUs per node: {m.gpus_per_node}")
    for link in ("p2p_intra", "p2p_inter", "allreduce_intra", "allreduce_inter"):
        c = getattr(m, link)
        print(f"  {link}: latency {c.latency_ms:.4f} ms, bandwidth {c.bandwidth / 1e9:.3f} GB/s")
    if m.core_sharing:
        print("  core sharing (k workers per core: times slower): "
              + ", ".join(f"{k}: x{v:.2f}" for k, v in enumerate(m.core_sharing, 1)))
    rows = [("#", "layer", "fwd ms", "+-", "bwd ms", "+-", "params", "grads", "optim", "activ", "output")]
    for i, x in enumerate(p.layers):
        rows.append((str(i), x.name, f"{x.forward_ms:.4f}", f"{x.forward_spread_ms:.4f}",
                     f"{x.backward_ms:.4f}", f"{x.backward_spread_ms:.4f}",
                     _fmt_bytes(x.param_bytes), _fmt_bytes(x.grad_bytes), _fmt_bytes(x.optimizer_bytes),
                     _fmt_bytes(x.activation_bytes), _fmt_bytes(x.output_bytes)))
    tot = p.layers
    rows.append(("", "total", f"{sum(x.forward_ms for x in tot):.4f}", "",
                 f"{sum(x.backward_ms for x in tot):.4f}", "",
                 _fmt_bytes(sum(x.param_bytes for x in tot)), _fmt_bytes(sum(x.grad_bytes for x in tot)),
                 _fmt_bytes(sum(x.optimizer_bytes for x in tot)),
                 _fmt_bytes(sum(x.activation_bytes for x in tot)), ""))
    _table(rows)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from oobleck_hpc.errors import ProfileError
    from oobleck_hpc.profiling.library import profile_files
    from oobleck_hpc.profiling.store import verify

    bad_roots = bad = total = 0
    for root in args.paths:
        try:
            files = profile_files(root)
        except ProfileError as e:
            print(f"BAD {root}: {e}")
            bad_roots += 1
            continue
        for f in files:
            total += 1
            try:
                verify(f)
                print(f"ok  {f}")
            except ProfileError as e:
                bad += 1
                print(f"BAD {f}: {e}")
    print(f"{total - bad} of {total} profile files valid")
    return 2 if bad or bad_roots else 0


def _import(args: argparse.Namespace) -> int:
    from oobleck_hpc.profiling.library import import_profiles

    report = import_profiles(args.src, args.library, "keep-both" if args.keep_both else "refuse")
    for line in report.lines():
        print(line)
    if not report.lines():
        print(f"no profile files under {args.src}")
    return 0 if report.ok else 2


def _diff(args: argparse.Namespace) -> int:
    from oobleck_hpc.profiling.store import diff_profiles, load_profile

    lines = diff_profiles(load_profile(args.a), load_profile(args.b))
    for line in lines:
        print(line)
    if not lines:
        print("identical")
    return 0


def _analytic(args: argparse.Namespace) -> int:
    from oobleck_hpc.profiling.analytic import analytic_profile
    from oobleck_hpc.profiling.library import library_path
    from oobleck_hpc.profiling.store import save_profile

    for model in args.models:
        for device in args.devices:
            for mb in args.microbatch:
                p = analytic_profile(model, device, mb, dtype=args.dtype, gpus_per_node=args.gpus_per_node)
                path = save_profile(p, library_path(args.library, p.fingerprint), overwrite=args.force)
                print(f"wrote {path}")
    return 0


def _check_step(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job
    from oobleck_hpc.profiling import resolve_profile
    from oobleck_hpc.profiling.profiler import measure_step_ms, predicted_single_gpu_step_ms

    job = load_job(args.job)
    m = args.microbatches or job.train.global_microbatches
    profile = resolve_profile(job)
    predicted = predicted_single_gpu_step_ms(profile, m)
    t = measure_step_ms(job, m, repeats=args.repeats)
    print(f"{job.model.name}, {m} microbatches of {job.train.microbatch_size}, one process:")
    print(f"  predicted by the planner from the profile:  {predicted:.2f} ms")
    print(f"  measured training step (AdamW), wall clock: {t.wall_ms:.2f} ms (IQR {t.wall_iqr_ms:.2f}), "
          f"prediction error {100 * (predicted - t.wall_ms) / t.wall_ms:+.1f} %")
    if t.cpu_ms:
        print(f"  measured training step, process CPU time:  {t.cpu_ms:.2f} ms, "
              f"prediction error {100 * (predicted - t.cpu_ms) / t.cpu_ms:+.1f} %")
        if t.wall_ms > 1.2 * t.cpu_ms:
            print("  (wall clock well above CPU time: other processes compete for the cores, so the "
                  "wall-clock figure measures the machine's load; compare with the CPU time)")
    return 0
