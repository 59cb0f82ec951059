"""`oobleck-hpc export RUN_DIR --hf OUT [--step N]`: a run's checkpoint as a Hugging Face model
directory, which `AutoModelForCausalLM.from_pretrained(OUT)` loads (its logits are ours).

The job (`--job`, default RUN_DIR/job.yaml) names the model (`model.hf`) and the checkpoint
directory (`checkpoint.dir`): the latest published checkpoint that verifies, or step N's, is
read layer by layer (the run's own format, `checkpoint.layer_state`: only its param/ tensors
are used; no torch.distributed, an offline command). OUT receives:

    config.json               the job's config.json, its `dtype` set to the tensors' (the run's
                              train.dtype: what from_pretrained's dtype="auto" gives), and
                              generation_config.json as is, if any
    model.safetensors         or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                              (shards of at most --max-shard-gb, 5 GB as transformers)
    tokenizer.json ...        tokenizer.json, tokenizer_config.json, special_tokens_map.json of
                              the job's data.tokenizer, those present

A tied tensor (tie_word_embeddings) is written once, under the embedding's name, as
save_pretrained does. OUT is written whole or not at all: into a temporary directory beside it,
renamed at the end; a non-empty OUT is refused unless --force (then replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from oobleck_hpc.errors import ConfigError

COPIED = ("generation_config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model directory",
                       description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the job's run directory (e.g. runs/tiny-llama)")
    p.add_argument("--hf", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint of step N (default: the latest that verifies)")
    p.add_argument("--job", default=None, metavar="JOB.yaml",
                   help="the job file (default: RUN_DIR/job.yaml)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="largest safetensors shard (default 5, as transformers)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from oobleck_hpc.config import load_job

    job_path = Path(args.job or Path(args.run_dir) / "job.yaml")
    if not job_path.exists():
        raise ConfigError("<command line>", "--job", f"{job_path} does not exist",
                          "pass the run's job file: --job JOB.yaml")
    step, files = export_hf(load_job(job_path), args.hf, args.step, force=args.force,
                            max_shard_bytes=int(args.max_shard_gb * 1e9))
    print(f"exported step {step} of {args.run_dir} to {args.hf}: {', '.join(files)}")
    return 0


def export_hf(job, out: str | Path, step: int | None = None, *, force: bool = False,
              max_shard_bytes: int | None = None) -> tuple[int, list[str]]:
    """Write `job`'s checkpoint (step `step`, or the latest) into `out` (module docstring);
    returns the step and the files written."""
    from oobleck_hpc.checkpoint import find_latest, open_checkpoint
    from oobleck_hpc.models.base import build_model
    from oobleck_hpc.models.hf_weights import MAX_SHARD_BYTES, save_hf_weights

    src = job.source
    if job.model.hf is None:
        raise ConfigError(src, "model.hf", "is not set: only a Hugging Face model exports as "
                          "one", "export a job whose model is model.hf")
    if job.checkpoint.dir is None:
        raise ConfigError(src, "checkpoint.dir", "is not set: the run wrote no checkpoint",
                          "set checkpoint.dir (and every_steps) for runs to export")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError("<command line>", "--hf", f"{out} exists and is not empty",
                          "name a new directory, or pass --force to replace it")
    if step is None:
        latest = find_latest(job.checkpoint.dir, quarantine=False)
        if latest.checkpoint is None:
            raise ConfigError(src, "checkpoint.dir", f"{job.checkpoint.dir} holds no published "
                              "checkpoint that verifies" + "".join(f"; {s}" for s in
                                                                  latest.skipped),
                              "export a run that saved a checkpoint (checkpoint.every_steps)")
        ckpt = latest.checkpoint
    else:
        ckpt = open_checkpoint(job.checkpoint.dir, step)
    model = build_model(job.model, src)
    if ckpt.num_layers != model.num_layers:
        raise ConfigError(src, "model.hf", f"{ckpt.path} has {ckpt.num_layers} layers, the "
                          f"model {model.num_layers}", "export with the run's own job file")
    second_copies = {b for _, b in model.tied_parameters()}
    state = {}
    for i in range(model.num_layers):
        layer = ckpt.layer(i)
        for ours, hf in model.hf_names(i).items():
            if (i, ours) not in second_copies:
                state[hf] = layer[f"param/{ours}"]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = json.loads((Path(job.model.hf) / "config.json").read_text())
        config.pop("torch_dtype", None)  # transformers < 4.56's name for it
        config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = [(Path(job.model.hf), n) for n in COPIED]
        if job.data.tokenizer is not None:
            copied += [(Path(job.data.tokenizer), n) for n in TOKENIZER_FILES]
        names = ["config.json"]
        for where, name in copied:
            if (where / name).exists():
                shutil.copyfile(where / name, tmp / name)
                names.append(name)
        names += save_hf_weights(state, tmp, max_shard_bytes or MAX_SHARD_BYTES)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt.step, names


def _replace(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out` (a rename); an `out` already there (empty, or --force) goes first."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.rename(tmp, out)
