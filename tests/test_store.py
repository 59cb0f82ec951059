"""HDF5 profile store: round trip, corruption and mismatch messages, atomic and concurrent writes."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import subprocess

import h5py
import pytest

from oobleck_hpc.errors import ProfileError
from oobleck_hpc.profiling import library, store
from oobleck_hpc.profiling.profile import (
    SCHEMA_VERSION,
    Fingerprint,
    LayerProfile,
    LinkCost,
    MachineProfile,
    ModelProfile,
)


def make_profile(model="toy", device="cpu", mb=2, dtype="float32", layers=3, scale=1.0,
                 gpus_per_node=2) -> ModelProfile:
    fp = Fingerprint(model_name=model, arch_hash="abc123", microbatch_size=mb, dtype=dtype,
                     device_name=device, gpus_per_node=gpus_per_node, interconnect="loopback",
                     torch_version="2.x", created_at="2026-01-01T00:00:00Z")
    link = LinkCost(latency_ms=0.05, bandwidth=1e9)
    machine = MachineProfile(device_name=device, device_memory_bytes=8 << 30,
                             gpus_per_node=gpus_per_node, p2p_intra=link, p2p_inter=link,
                             allreduce_intra=LinkCost(0.1, 2e9), allreduce_inter=LinkCost(0.2, 1e9),
                             interconnect="loopback")
    ls = tuple(LayerProfile(name=f"layer{i} é", forward_ms=scale * (1.5 + i), backward_ms=3.25 * scale,
                            param_bytes=1000 * (i + 1), grad_bytes=1000 * (i + 1),
                            optimizer_bytes=2000 * (i + 1), activation_bytes=12345 + i,
                            output_bytes=4096, forward_spread_ms=0.01, backward_spread_ms=0.02,
                            optimizer_ms=0.125 * (i + 1),
                            forward_rows_ms=tuple(scale * (1.5 + i) * (r + 2) / (mb + 2)
                                                  for r in range(1, mb + 1)),
                            backward_rows_ms=tuple(3.25 * scale * (r + 1) / (mb + 1)
                                                   for r in range(1, mb + 1)))
               for i in range(layers))
    return ModelProfile(fp, machine, ls)


def test_round_trip_and_layout(tmp_path):
    p = make_profile()
    path = library.library_path(tmp_path, p.fingerprint)
    assert path == tmp_path / "toy" / "cpu" / "float32-mb2.h5"
    store.save_profile(p, path)
    assert store.load_profile(path) == p
    assert store.verify(path) == p
    with h5py.File(path, "r") as f:  # the layout h5dump shows
        assert f.attrs["format"] == store.FORMAT
        assert f.attrs["model_name"] == "toy" and int(f.attrs["microbatch_size"]) == 2
        assert len(f.attrs["checksum_sha256"]) == 64
        assert list(f["layers/forward_ms"][()]) == [1.5, 2.5, 3.5]
        assert f["machine"].attrs["p2p_inter_bandwidth"] == 1e9
    # no temporary files are left behind
    assert [x.name for x in path.parent.iterdir()] == ["float32-mb2.h5"]


def test_save_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "p.h5"
    store.save_profile(make_profile(), path)
    with pytest.raises(ProfileError, match="refusing to overwrite.*--force"):
        store.save_profile(make_profile(scale=2.0), path)
    assert store.load_profile(path) == make_profile()
    store.save_profile(make_profile(scale=2.0), path, overwrite=True)
    assert store.load_profile(path) == make_profile(scale=2.0)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"nothere\.h5 does not exist.*oobleck-hpc profile"):
        store.load_profile(tmp_path / "nothere.h5")


def test_truncated_file(tmp_path):
    path = tmp_path / "p.h5"
    store.save_profile(make_profile(), path)
    data = path.read_bytes()
    bad = tmp_path / "trunc.h5"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileError, match=r"trunc\.h5.*(corrupt or truncated).*Fix:"):
        store.load_profile(bad)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(ProfileError, match=r"garbage\.h5 is not a readable HDF5 file"):
        store.load_profile(garbage)


def test_checksum_mismatch_and_load_never_modifies(tmp_path):
    path = tmp_path / "p.h5"
    store.save_profile(make_profile(), path)
    with h5py.File(path, "r+") as f:
        f["layers/forward_ms"][1] = 99.0
    before = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    with pytest.raises(ProfileError, match=r"p\.h5: checksum mismatch.*modified or damaged"):
        store.load_profile(path)
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    # metadata is covered too
    store.save_profile(make_profile(), path, overwrite=True)
    with h5py.File(path, "r+") as f:
        f["machine"].attrs["p2p_inter_bandwidth"] = 1e12
    with pytest.raises(ProfileError, match="checksum mismatch"):
        store.load_profile(path)


def test_schema_1_file_is_still_read(tmp_path):
    """A schema 1 file (no optimizer_ms, no per-row times) loads with those fields empty, and
    its checksum still covers its own datasets."""
    import dataclasses

    v2 = make_profile()
    fp1 = dataclasses.replace(v2.fingerprint, schema_version=1)
    v1 = ModelProfile(fp1, v2.machine, tuple(
        dataclasses.replace(x, optimizer_ms=0.0, forward_rows_ms=(), backward_rows_ms=())
        for x in v2.layers))
    path = tmp_path / "v1.h5"
    store.save_profile(v2, path)
    with h5py.File(path, "r+") as f:
        for name in ("optimizer_ms", "forward_rows_ms", "backward_rows_ms"):
            del f["layers"][name]
        f.attrs["schema_version"] = 1
        f.attrs["checksum_sha256"] = store.profile_checksum(v1)
    assert store.load_profile(path) == v1
    with h5py.File(path, "r+") as f:
        f["layers"]["forward_ms"][0] = 99.0
    with pytest.raises(ProfileError, match="checksum mismatch"):
        store.load_profile(path)


def test_core_sharing_round_trips_and_schema_2_files_have_none(tmp_path):
    """Schema 3 stores the CPU core-sharing table under /machine (checksummed); a schema 2 file
    has no such attribute and loads with an empty table."""
    import dataclasses

    p = make_profile()
    p3 = dataclasses.replace(p, machine=dataclasses.replace(p.machine, core_sharing=(1.0, 2.25)))
    path = tmp_path / "v3.h5"
    store.save_profile(p3, path)
    assert store.load_profile(path).machine.core_sharing == (1.0, 2.25)
    with h5py.File(path, "r+") as f:
        f["machine"].attrs["core_sharing"] = [1.0, 2.5]
    with pytest.raises(ProfileError, match="checksum mismatch"):
        store.load_profile(path)
    v2 = dataclasses.replace(p, fingerprint=dataclasses.replace(p.fingerprint, schema_version=2))
    path2 = tmp_path / "v2.h5"
    store.save_profile(p, path2)
    with h5py.File(path2, "r+") as f:
        f.attrs["schema_version"] = 2
        f.attrs["checksum_sha256"] = store.profile_checksum(v2)
    assert store.load_profile(path2) == v2 and v2.machine.core_sharing == ()


def test_wrong_schema_and_foreign_file(tmp_path):
    path = tmp_path / "p.h5"
    store.save_profile(make_profile(), path)
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(ProfileError, match=rf"schema_version 99.*reads schema {SCHEMA_VERSION}"):
        store.load_profile(path)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=[1, 2, 3])
    with pytest.raises(ProfileError, match=r"other\.h5 is HDF5 but not an oobleck_hpc profile"):
        store.load_profile(other)
    store.save_profile(make_profile(), path, overwrite=True)
    with h5py.File(path, "r+") as f:
        del f["layers/grad_bytes"]
    with pytest.raises(ProfileError, match=r"'/layers/grad_bytes' missing"):
        store.load_profile(path)


def test_list_and_diff(tmp_path):
    store.save_profile(make_profile(), library.library_path(tmp_path, make_profile().fingerprint))
    q = make_profile(model="other", mb=4, scale=2.0)
    store.save_profile(q, library.library_path(tmp_path, q.fingerprint))
    (tmp_path / "bad.h5").write_bytes(b"junk")
    entries = library.list_library(tmp_path)
    assert [e.path.name for e in entries] == ["bad.h5", "float32-mb4.h5", "float32-mb2.h5"]
    assert entries[0].profile is None and "not a readable HDF5" in entries[0].error
    d = store.diff_profiles(make_profile(), q)
    assert "fingerprint.model_name: 'toy' -> 'other'" in d
    assert any(line.startswith("layer 0 (layer0 é) forward_ms: 1.5 -> 3 (+100.0 %)") for line in d)


def test_import_policies(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    a = make_profile()
    store.save_profile(a, library.library_path(src, a.fingerprint))
    (src / "broken.h5").write_bytes(b"junk")
    r = library.import_profiles(src, dst)
    assert len(r.imported) == 1 and len(r.invalid) == 1 and not r.ok
    r = library.import_profiles(src, dst)
    assert len(r.identical) == 1 and not r.imported
    # a different profile under the same canonical name: refused, existing file untouched
    other = tmp_path / "other"
    store.save_profile(make_profile(scale=3.0), library.library_path(other, a.fingerprint))
    r = library.import_profiles(other, dst)
    assert len(r.refused) == 1 and "REFUSED" in r.lines()[0]
    assert store.load_profile(library.library_path(dst, a.fingerprint)) == a
    r = library.import_profiles(other, dst, on_conflict="keep-both")
    (s, kept), = r.kept_both
    assert kept.name.startswith("float32-mb2.") and store.load_profile(kept) == make_profile(scale=3.0)
    assert store.load_profile(library.library_path(dst, a.fingerprint)) == a


def _import_worker(src: str, dst: str, q) -> None:
    try:
        r = library.import_profiles(src, dst, on_conflict="keep-both")
        q.put((len(r.imported), len(r.identical), len(r.kept_both), len(r.refused), len(r.invalid)))
    except BaseException as e:  # report, do not hang the parent
        q.put(repr(e))


@pytest.mark.timeout(120)
def test_concurrent_imports_leave_every_file_valid(tmp_path):
    """Several processes import overlapping libraries into one destination at the same time."""
    srcs = []
    for k in range(4):
        src = tmp_path / f"src{k}"
        for m in range(6):  # the same 6 names from every source; sources 0 and 1 identical
            p = make_profile(model=f"m{m}", layers=40, scale=1.0 if k < 2 else float(k))
            store.save_profile(p, library.library_path(src, p.fingerprint))
        srcs.append(src)
    dst = tmp_path / "dst"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_import_worker, args=(str(s), str(dst), q)) for s in srcs]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=100) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(isinstance(r, tuple) for r in results), results
    imported = sum(r[0] for r in results)
    kept = sum(r[2] for r in results)
    # 6 canonical names + 2 kept-both variants (sources 2 and 3) per name whichever order they ran
    files = library.profile_files(dst)
    assert len(files) == imported + kept == 18
    for f in files:
        store.verify(f)
    assert not [x for x in dst.rglob(".*")], "temporary files left behind"


def test_h5dump_reads_the_file(tmp_path):
    if shutil.which("h5dump") is None:
        pytest.skip("h5dump (hdf5-tools) not installed")
    path = tmp_path / "p.h5"
    store.save_profile(make_profile(), path)
    out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, check=True).stdout
    assert "forward_ms" in out and "checksum_sha256" in out
