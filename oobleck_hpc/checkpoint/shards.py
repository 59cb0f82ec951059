"""The files of a checkpoint: one binary shard format and the manifest built from the writers'
completion records.

A shard file (`layer-<i>.bin`, `train.bin`): 8-byte magic, 8-byte little-endian header length, a
JSON header (format, meta, one entry per tensor: key, dtype, shape, offset, bytes), then each
tensor's raw bytes at a 64-byte aligned offset. No pickle: loading never executes code from the
file. `write_shard` fsyncs and returns the file's size and sha256; `read_shard` checks them
against the manifest while reading.

A completion record (`done-rank<r>.json`, `completion_record`) lists what one writer wrote; the
manifest (MANIFEST.json, `build_manifest`) is built from all of them once they cover every layer
and the training state.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from oobleck_hpc.errors import CheckpointError

FORMAT_VERSION = 1
_MAGIC = b"OOBLCKPT"
_ALIGN = 64


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor], meta: Any = None) -> dict[str, Any]:
    """Write header + raw tensor bytes (see the module docstring), fsync; return {size, sha256}
    of the file's bytes."""
    entries, offset = [], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    header = json.dumps({"format": FORMAT_VERSION, "meta": meta, "tensors": entries}).encode()
    start = -(-(16 + len(header)) // _ALIGN) * _ALIGN
    head = _MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (start - len(head))
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in _chunks(head, tensors, entries):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _chunks(head: bytes, tensors: Mapping[str, torch.Tensor], entries: list[dict]):
    yield head
    for e in entries:
        t = tensors[e["key"]]
        if e["nbytes"]:
            yield memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        pad = -e["nbytes"] % _ALIGN
        if pad:
            yield b"\0" * pad


def read_shard(path: Path, expect: Mapping[str, Any] | None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Read a shard file, check size and sha256 against `expect`, return (meta, tensors)."""
    try:
        size = path.stat().st_size
        buf = bytearray(size)
        with open(path, "rb") as f:
            got = f.readinto(buf)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e
    if got != size:
        raise CheckpointError(f"{path}: read {got} of {size} bytes")
    if expect is not None:
        if size != expect["size"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {expect['size']} "
                                  f"(truncated or overwritten)")
        sha = hashlib.sha256(buf).hexdigest()
        if sha != expect["sha256"]:
            raise CheckpointError(f"{path}: sha256 {sha[:16]}... differs from the manifest's "
                                  f"{expect['sha256'][:16]}... (the file is corrupt)")
    if size < 16 or bytes(buf[:8]) != _MAGIC:
        raise CheckpointError(f"{path}: not a checkpoint shard (bad magic)")
    hlen = int.from_bytes(buf[8:16], "little")
    try:
        header = json.loads(bytes(buf[16:16 + hlen]))
    except ValueError as e:
        raise CheckpointError(f"{path}: unreadable header ({e})") from e
    start = -(-(16 + hlen) // _ALIGN) * _ALIGN
    tensors = {}
    data = memoryview(buf)[start:]
    for e in header["tensors"]:
        dtype = getattr(torch, e["dtype"])
        raw = data[e["offset"]:e["offset"] + e["nbytes"]]
        if len(raw) != e["nbytes"]:
            raise CheckpointError(f"{path}: tensor {e['key']!r} runs past the end of the file")
        t = torch.frombuffer(raw, dtype=dtype) if e["nbytes"] else torch.empty(0, dtype=dtype)
        tensors[e["key"]] = t.reshape(e["shape"])
    return header["meta"], tensors


def completion_record(step: int, rank: int, num_layers: int, files: Mapping[str, Any],
                      host: str, written_at: float) -> dict[str, Any]:
    """What rank `rank` wrote of checkpoint `step` (`done-rank<r>.json`): each file's size and
    sha256, with `layer` (its index) or `train` (True) saying what the file holds."""
    return {"format": FORMAT_VERSION, "step": step, "rank": rank, "num_layers": num_layers,
            "files": dict(files), "host": host, "written_at": written_at}


def build_manifest(where: Path, step: int, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """MANIFEST.json of checkpoint `step` from its writers' completion records, or None while
    some layer or the training state is not covered yet (others are still writing).
    Deterministic: two publishers build the same bytes from the same records. Raises
    CheckpointError when the records disagree on the step or the number of layers."""
    num_layers = records[0]["num_layers"]
    layers: dict[str, str] = {}
    files: dict[str, dict[str, Any]] = {}
    train = None
    for rec in sorted(records, key=lambda r: r["rank"]):
        if rec["num_layers"] != num_layers or rec["step"] != step:
            raise CheckpointError(f"{where}: completion records disagree (rank {rec['rank']} wrote "
                                  f"step {rec['step']} of {rec['num_layers']} layers, rank "
                                  f"{records[0]['rank']} step {records[0]['step']} of {num_layers})")
        for name, f in rec["files"].items():
            if "layer" in f:
                layers.setdefault(str(f["layer"]), name)
            if f.get("train"):
                train = name
            files.setdefault(name, {"size": f["size"], "sha256": f["sha256"]})
    if train is None or len(layers) < num_layers:
        return None
    return {"format": FORMAT_VERSION, "step": step, "num_layers": num_layers,
            "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0]))),
            "train": train, "files": dict(sorted(files.items())),
            "writers": sorted(r["rank"] for r in records),
            "written_at": max(r["written_at"] for r in records)}
