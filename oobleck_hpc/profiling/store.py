"""HDF5 profile files: writing, reading, verifying, copying, comparing. The ONLY module of the
package that imports h5py (the library of such files, its paths and imports: library.py).

File layout (one file per model x device x dtype x microbatch size; `h5dump FILE` shows all of it):

    /                      attributes: format = "oobleck_hpc.profile", schema_version,
                           every Fingerprint field (model_name, arch_hash, microbatch_size, dtype,
                           device_name, gpus_per_node, interconnect, source, torch_version,
                           cuda_version, nccl_version, tool_version, created_at),
                           checksum_sha256
    /machine               group; attributes: device_name, device_memory_bytes, gpus_per_node,
                           interconnect, and for each link L in (p2p_intra, p2p_inter,
                           allreduce_intra, allreduce_inter): L_latency_ms, L_bandwidth;
                           schema 3 adds core_sharing (float64 array; absent when empty)
    /layers/<field>        one 1-D dataset per LayerProfile field, one row per layer in model order:
                           name (UTF-8 strings), forward_ms, backward_ms, forward_spread_ms,
                           backward_spread_ms (float64), param_bytes, grad_bytes, optimizer_bytes,
                           activation_bytes, output_bytes (int64); schema 2 adds
                           optimizer_ms (float64) and forward_rows_ms, backward_rows_ms
                           (float64, 2-D: one row per layer, column r-1 = time at r microbatch
                           rows; 0 columns when not measured). Schema 1 and 2 files are still
                           read (checksummed over their own datasets); new files are schema 3.

`checksum_sha256` is the SHA-256 of a canonical serialisation of the datasets (field name, dtype,
shape, raw little-endian bytes, in a fixed field order) followed by the canonical JSON of the
fingerprint and machine attributes. Any change to numbers or metadata after writing is caught by
`load_profile` / `verify`.

Durability and concurrency (several jobs on several nodes may write one shared NFS/Lustre
library at once):
- every write (`save_profile`, `copy_profile`) goes to a temporary file in the destination
  directory (`files.temp_path`: hidden, unique per process and thread), is flushed and fsync'ed,
  then published with one atomic directory operation -- `os.replace` when overwriting is
  allowed, `os.link` (fails if the name exists, so never clobbers) otherwise -- and the
  directory is fsync'ed (best effort). A reader therefore sees either no file or a complete
  one, never a half-written one.
- loading opens files read-only and never modifies them. HDF5 file locking is off: a published
  file is never written again (replacement is a new inode), and locks fail on many NFS mounts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np

from oobleck_hpc.errors import ProfileError
from oobleck_hpc.files import fsync_dir, fsync_file, temp_path
from oobleck_hpc.profiling.profile import (
    READ_SCHEMAS,
    SCHEMA_VERSION,
    Fingerprint,
    LayerProfile,
    LinkCost,
    MachineProfile,
    ModelProfile,
)

FORMAT = "oobleck_hpc.profile"
SUFFIX = ".h5"
_LINKS = ("p2p_intra", "p2p_inter", "allreduce_intra", "allreduce_inter")
_FLOAT_FIELDS = ("forward_ms", "backward_ms", "forward_spread_ms", "backward_spread_ms")
_INT_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes")
_V1_FIELDS = ("name",) + _FLOAT_FIELDS + _INT_FIELDS
_ROWS_FIELDS = ("forward_rows_ms", "backward_rows_ms")
_V2_FLOAT = ("optimizer_ms",)
_LAYER_FIELDS = _V1_FIELDS + _V2_FLOAT + _ROWS_FIELDS
"""Datasets of the schemas 2 and 3 (this version writes 3); a schema 1 file has only _V1_FIELDS."""
_FP_FIELDS = tuple(f.name for f in dataclasses.fields(Fingerprint))
_FP_INT = {"microbatch_size", "gpus_per_node", "schema_version"}


def _fields(schema: int) -> tuple[str, ...]:
    return _V1_FIELDS if schema == 1 else _LAYER_FIELDS


# ----------------------------------------------------------------------------- checksum


def _layer_arrays(layers: tuple[LayerProfile, ...]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {
        "name": np.array([x.name.encode("utf-8") for x in layers], dtype=object)}
    for f in _FLOAT_FIELDS:
        arrays[f] = np.array([getattr(x, f) for x in layers], dtype="<f8")
    for f in _INT_FIELDS:
        arrays[f] = np.array([getattr(x, f) for x in layers], dtype="<i8")
    for f in _V2_FLOAT:
        arrays[f] = np.array([getattr(x, f) for x in layers], dtype="<f8")
    for f in _ROWS_FIELDS:
        widths = {len(getattr(x, f)) for x in layers}
        if len(widths) > 1:
            raise ProfileError(f"layers have {f} of different lengths {sorted(widths)}; every "
                               f"layer must be measured at the same row counts")
        width = widths.pop() if widths else 0
        arrays[f] = np.array([list(getattr(x, f)) for x in layers],
                             dtype="<f8").reshape(len(layers), width)
    return arrays


def _machine_attrs(machine: MachineProfile) -> dict[str, object]:
    attrs: dict[str, object] = {
        "device_name": machine.device_name,
        "device_memory_bytes": int(machine.device_memory_bytes),
        "gpus_per_node": int(machine.gpus_per_node),
        "interconnect": machine.interconnect,
    }
    for link in _LINKS:
        cost: LinkCost = getattr(machine, link)
        attrs[f"{link}_latency_ms"] = float(cost.latency_ms)
        attrs[f"{link}_bandwidth"] = float(cost.bandwidth)
    if machine.core_sharing:  # schema 3; absent when empty, so older files checksum as before
        attrs["core_sharing"] = [float(x) for x in machine.core_sharing]
    return attrs


def _checksum(arrays: dict[str, np.ndarray], fingerprint: Fingerprint, machine: MachineProfile) -> str:
    h = hashlib.sha256()
    for name in _fields(fingerprint.schema_version):
        a = arrays[name]
        if name == "name":
            data = b"\0".join(a.tolist())
            h.update(f"{name}|str|{len(a)}|".encode())
        else:
            data = np.ascontiguousarray(a).tobytes()
            shape = len(a) if a.ndim == 1 else "x".join(str(d) for d in a.shape)
            h.update(f"{name}|{a.dtype.str}|{shape}|".encode())
        h.update(data)
    meta = {"fingerprint": asdict(fingerprint), "machine": _machine_attrs(machine)}
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def profile_checksum(profile: ModelProfile) -> str:
    """The checksum `save_profile` stores for this profile."""
    return _checksum(_layer_arrays(profile.layers), profile.fingerprint, profile.machine)


# ----------------------------------------------------------------------------- durable writes


def _publish(tmp: Path, dest: Path, overwrite: bool) -> bool:
    """Move a complete, fsync'ed temporary file to `dest` atomically. Returns False (and leaves
    `dest` alone) when `dest` exists and `overwrite` is False."""
    if overwrite:
        os.replace(tmp, dest)
    else:
        try:
            os.link(tmp, dest)  # atomic create-if-absent, also on NFS
        except FileExistsError:
            return False
        finally:
            if tmp.exists():
                tmp.unlink()
    fsync_dir(dest.parent, best_effort=True)
    return True


def _write_h5(profile: ModelProfile, path: Path) -> str:
    arrays = _layer_arrays(profile.layers)
    checksum = _checksum(arrays, profile.fingerprint, profile.machine)
    with h5py.File(path, "w", locking=False) as f:  # a private temp file
        f.attrs["format"] = FORMAT
        for name in _FP_FIELDS:
            value = getattr(profile.fingerprint, name)  # plain str/int (str subclasses do not convert)
            f.attrs[name] = int(value) if name in _FP_INT else str(value)
        f.attrs["checksum_sha256"] = checksum
        machine = f.create_group("machine")
        for k, v in _machine_attrs(profile.machine).items():
            machine.attrs[k] = str(v) if isinstance(v, str) else v
        layers = f.create_group("layers")
        for name in _LAYER_FIELDS:
            if name == "name":
                layers.create_dataset(name, data=np.array([s.decode() for s in arrays[name]], dtype=object),
                                      dtype=h5py.string_dtype("utf-8"))
            else:
                layers.create_dataset(name, data=arrays[name])
        f.flush()
    return checksum


def save_profile(profile: ModelProfile, path: str | Path, overwrite: bool = False) -> Path:
    """Write `profile` to `path` atomically (temporary file in the same directory, fsync, rename,
    fsync of the directory). An existing file is replaced only with `overwrite=True`; otherwise a
    ProfileError says so (nothing already written is lost)."""
    path = Path(path)
    if profile.fingerprint.schema_version != SCHEMA_VERSION:
        raise ProfileError(f"cannot write {path}: profile has schema_version "
                           f"{profile.fingerprint.schema_version}, this version writes {SCHEMA_VERSION}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not overwrite:
        raise ProfileError(f"{path} already exists; refusing to overwrite it. Fix: pass "
                           f"--force (overwrite=True) to replace it, or write to another --out directory")
    tmp = temp_path(path)
    try:
        _write_h5(profile, tmp)
        fsync_file(tmp)
        if not _publish(tmp, path, overwrite):
            raise ProfileError(f"{path} was created by another process while this one was "
                               f"writing; left it untouched. Fix: pass --force to replace it")
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ----------------------------------------------------------------------------- reading


def _attr(obj: h5py.HLObject, name: str, path: Path, where: str) -> object:
    if name not in obj.attrs:
        raise ProfileError(f"{path}: attribute '{name}' missing in {where}; the file is not a "
                           f"complete oobleck_hpc profile (schema {SCHEMA_VERSION}). Fix: re-create it "
                           f"with `oobleck-hpc profile JOB.yaml` or re-import it from its source")
    value = obj.attrs[name]
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if isinstance(value, np.generic):
        value = value.item()
    return value


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile written by `save_profile`. The file is opened read-only and never modified.
    Raises ProfileError (naming the file and the fix) when it is missing, not HDF5, truncated,
    of another schema, incomplete, or when its checksum does not match its content."""
    path = Path(path)
    fix = ("Fix: re-create it with `oobleck-hpc profile JOB.yaml`, re-import it from its "
           "source library, or delete it")
    if not path.is_file():
        raise ProfileError(f"profile {path} does not exist. Fix: create it with "
                           f"`oobleck-hpc profile JOB.yaml` or point profile.path at an existing file")
    try:
        f = h5py.File(path, "r", locking=False)  # immutable once published; NFS-safe
    except OSError as e:
        raise ProfileError(f"{path} is not a readable HDF5 file (corrupt or truncated: {e}). {fix}") from e
    try:
        with f:
            fmt = f.attrs.get("format")
            if isinstance(fmt, bytes):
                fmt = fmt.decode()
            if fmt != FORMAT:
                raise ProfileError(f"{path} is HDF5 but not an oobleck_hpc profile (format "
                                   f"attribute {fmt!r}, expected {FORMAT!r}). {fix}")
            schema = _attr(f, "schema_version", path, "/")
            if schema not in READ_SCHEMAS:
                raise ProfileError(f"{path} has schema_version {schema}, this version of oobleck_hpc "
                                   f"reads schema {SCHEMA_VERSION} (and older: "
                                   f"{', '.join(map(str, READ_SCHEMAS))}). Fix: re-create the "
                                   f"profile with this version (`oobleck-hpc profile JOB.yaml`)")
            fp_values = {}
            for name in _FP_FIELDS:
                v = _attr(f, name, path, "/")
                fp_values[name] = int(v) if name in _FP_INT else str(v)
            fingerprint = Fingerprint(**fp_values)
            stored = str(_attr(f, "checksum_sha256", path, "/"))
            if "machine" not in f or "layers" not in f:
                raise ProfileError(f"{path}: group '/machine' or '/layers' missing. {fix}")
            m = f["machine"]
            links = {link: LinkCost(latency_ms=float(_attr(m, f"{link}_latency_ms", path, "/machine")),
                                    bandwidth=float(_attr(m, f"{link}_bandwidth", path, "/machine")))
                     for link in _LINKS}
            machine = MachineProfile(
                device_name=str(_attr(m, "device_name", path, "/machine")),
                device_memory_bytes=int(_attr(m, "device_memory_bytes", path, "/machine")),
                gpus_per_node=int(_attr(m, "gpus_per_node", path, "/machine")),
                interconnect=str(_attr(m, "interconnect", path, "/machine")),
                core_sharing=tuple(float(x) for x in m.attrs.get("core_sharing", ())),
                **links)
            g = f["layers"]
            arrays: dict[str, np.ndarray] = {}
            for name in _fields(schema):
                if name not in g:
                    raise ProfileError(f"{path}: dataset '/layers/{name}' missing. {fix}")
                if name == "name":
                    arrays[name] = np.array([s if isinstance(s, bytes) else s.encode()
                                             for s in g[name][()]], dtype=object)
                else:
                    arrays[name] = np.asarray(g[name][()], dtype="<i8" if name in _INT_FIELDS else "<f8")
            for name in _ROWS_FIELDS:
                if name in arrays and arrays[name].ndim != 2:
                    raise ProfileError(f"{path}: dataset '/layers/{name}' has shape "
                                       f"{arrays[name].shape}, expected (layers, rows). {fix}")
            lengths = {len(a) for a in arrays.values()}
            if len(lengths) != 1:
                raise ProfileError(f"{path}: the /layers datasets have different lengths "
                                   f"{sorted(lengths)}. {fix}")
    except ProfileError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise ProfileError(f"{path} could not be read ({type(e).__name__}: {e}); the file is "
                           f"corrupt or truncated. {fix}") from e
    actual = _checksum(arrays, fingerprint, machine)
    if actual != stored:
        raise ProfileError(f"{path}: checksum mismatch (stored {stored[:16]}..., content "
                           f"{actual[:16]}...): the file was modified or damaged after it was "
                           f"written. {fix}")
    layers = tuple(
        LayerProfile(name=arrays["name"][i].decode("utf-8"),
                     **{k: float(arrays[k][i]) for k in _FLOAT_FIELDS + _V2_FLOAT if k in arrays},
                     **{k: int(arrays[k][i]) for k in _INT_FIELDS},
                     **{k: tuple(float(v) for v in arrays[k][i]) for k in _ROWS_FIELDS
                        if k in arrays})
        for i in range(len(arrays["name"])))
    return ModelProfile(fingerprint=fingerprint, machine=machine, layers=layers)


def copy_profile(src: Path, dest: Path, overwrite: bool) -> bool:
    """Copy the profile file `src` to `dest` through a verified, fsync'ed temporary file (the
    copy is complete and valid before it gets its name). False: `dest` existed and `overwrite`
    is False (nothing written)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest)
    try:
        shutil.copyfile(src, tmp)
        fsync_file(tmp)
        load_profile(tmp)
        return _publish(tmp, dest, overwrite)
    finally:
        if tmp.exists():
            tmp.unlink()


def stored_checksum(path: str | Path) -> str:
    """The checksum attribute of a file (after `load_profile` has verified it)."""
    load_profile(path)
    with h5py.File(path, "r", locking=False) as f:
        v = f.attrs["checksum_sha256"]
    return v.decode() if isinstance(v, bytes) else str(v)


def verify(path: str | Path) -> ModelProfile:
    """Check schema, completeness and checksum of one file; returns the profile or raises
    ProfileError. (The same checks `load_profile` does: loading is verifying.)"""
    return load_profile(path)


# ----------------------------------------------------------------------------- comparison


def diff_profiles(a: ModelProfile, b: ModelProfile) -> list[str]:
    """Human-readable differences, fingerprint and machine first, then layer by layer."""
    out = []
    for k in _FP_FIELDS:
        va, vb = getattr(a.fingerprint, k), getattr(b.fingerprint, k)
        if va != vb:
            out.append(f"fingerprint.{k}: {va!r} -> {vb!r}")
    ma, mb = _machine_attrs(a.machine), _machine_attrs(b.machine)
    for k in ma:
        if ma[k] != mb[k]:
            out.append(f"machine.{k}: {ma[k]!r} -> {mb[k]!r}")
    if a.num_layers != b.num_layers:
        out.append(f"layers: {a.num_layers} -> {b.num_layers}")
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        for k in _LAYER_FIELDS:
            vx, vy = getattr(x, k), getattr(y, k)
            if vx != vy:
                if isinstance(vx, (int, float)) and not isinstance(vx, bool) and vx:
                    out.append(f"layer {i} ({x.name}) {k}: {vx:g} -> {vy:g} ({100 * (vy - vx) / vx:+.1f} %)")
                else:
                    out.append(f"layer {i} ({x.name}) {k}: {vx!r} -> {vy!r}")
    return out
