"""Pre-tokenized datasets, used in place: `data.tokens: PATH` is memory-mapped read-only
(`np.memmap`), never copied or converted. The file's suffix says its format:

- `FILE.bin`: a flat token file as nanoGPT's prepare.py writes it -- the token ids one after
  the other, no header, little-endian. Its type is not in the file: `data.dtype` says it
  (uint16 for GPT-2's 50,257 ids, uint32 beyond 65,536).
- `FILE.npy`: a one-dimensional NumPy array of an integer type (`np.save`); the header says
  the type.
- `PREFIX.idx`: a Megatron-LM indexed dataset (the layout Megatron-LM and GPT-NeoX write),
  PREFIX.idx beside PREFIX.bin. The .idx, little-endian:

      bytes 0..8    magic b"MMIDIDX\\x00\\x00"
      bytes 9..16   version, uint64 = 1
      byte  17      dtype code, uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
                    (6 float64 and 7 float32 are not token ids)
      bytes 18..25  sequence count S, uint64
      bytes 26..33  document count D, uint64
      then          sizes int32[S] (tokens per sequence), pointers int64[S] (byte offset of each
                    sequence in PREFIX.bin), document indices int64[D] (0, then the sequence
                    index at which each document ends: the last is S), and, in multimodal
                    datasets only, modes int8[S] (ignored here)

  PREFIX.bin holds the sequences' tokens back to back. The training stream is every sequence
  in order -- the documents concatenated in order, with whatever end-of-document token the
  writer appended (Megatron's --append-eod), and nothing added between them -- which is
  PREFIX.bin itself when the sequences lie in it in order without gaps, as Megatron writes
  them; a dataset laid out otherwise is refused (the stream would need a copy).

Everything read from these files is checked before it is used: sizes against the files'
lengths, the index's magic, version, type, counts, pointers and document indices. A problem
is a ConfigError naming the file, the key `data.tokens` and the fix.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NoReturn

import numpy as np

from oobleck_hpc.errors import ConfigError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_HEADER_BYTES = 34
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FORMATS = {".bin": "bin", ".npy": "npy", ".idx": "megatron"}
_KEY = "data.tokens"
_REWRITE = "write it again with Megatron-LM's tools/preprocess_data.py"


def _fail(source: str, path: Path, problem: str, fix: str) -> NoReturn:
    raise ConfigError(source, _KEY, f"file {path} {problem}", fix)


def _size(path: Path, source: str) -> int:
    if not path.is_file():
        _fail(source, path, "does not exist", "give the path of your pre-tokenized data "
              "(FILE.bin with data.dtype, FILE.npy, or a Megatron PREFIX.idx)")
    return path.stat().st_size


def open_flat(path: str | Path, dtype: str, source: str = "<job>") -> np.ndarray:
    """A flat token file (nanoGPT's .bin) of `dtype` (data.dtype: uint16 or uint32),
    memory-mapped."""
    if dtype not in ("uint16", "uint32"):  # a job's is checked by DataConfig; this for callers
        raise ValueError(f"a flat .bin holds uint16 or uint32 tokens, not {dtype!r}")
    path = Path(path).expanduser()
    itemsize = np.dtype(dtype).itemsize
    size = _size(path, source)
    if size == 0 or size % itemsize:
        _fail(source, path, f"has {size} bytes, not a whole positive number of {dtype} tokens",
              "check data.dtype (nanoGPT writes uint16) and that the file was written completely")
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def open_npy(path: str | Path, source: str = "<job>") -> np.ndarray:
    """A one-dimensional integer .npy array, memory-mapped."""
    path = Path(path).expanduser()
    _size(path, source)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        _fail(source, path, f"is not a readable .npy array ({e})",
              "write it with numpy.save(path, tokens)")
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or tokens.size == 0:
        _fail(source, path, f"holds a {tokens.dtype} array of shape {tokens.shape}, not a "
              "non-empty one-dimensional array of token ids", "save the token ids as one flat "
              "integer array, e.g. numpy.save(path, ids.astype(numpy.uint16))")
    return tokens


def _megatron_index(idx: Path, source: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, sizes, pointers) of a Megatron .idx, every field validated."""
    size = _size(idx, source)
    with open(idx, "rb") as f:
        head = f.read(MEGATRON_HEADER_BYTES)
    if len(head) < MEGATRON_HEADER_BYTES or head[:9] != MEGATRON_MAGIC:
        _fail(source, idx, "is not a Megatron-LM index (no MMIDIDX header)",
              f"give the .idx of a Megatron indexed dataset, or {_REWRITE}")
    (version,) = struct.unpack("<Q", head[9:17])
    code = head[17]
    seqs, docs = struct.unpack("<QQ", head[18:34])
    if version != MEGATRON_VERSION:
        _fail(source, idx, f"has index version {version}, not {MEGATRON_VERSION}", _REWRITE)
    if code not in MEGATRON_DTYPES:
        _fail(source, idx, f"has dtype code {code}, not an integer token type (codes "
              f"{sorted(MEGATRON_DTYPES)})", _REWRITE)
    body = 12 * seqs + 8 * docs
    if size - MEGATRON_HEADER_BYTES not in (body, body + seqs):  # + int8 modes (multimodal)
        _fail(source, idx, f"has {size} bytes, but its header promises {seqs} sequences and "
              f"{docs} document indices ({MEGATRON_HEADER_BYTES + body} bytes)",
              f"it is truncated or damaged: {_REWRITE}")
    sizes = np.memmap(idx, dtype="<i4", mode="r", offset=MEGATRON_HEADER_BYTES, shape=(seqs,)) \
        if seqs else np.zeros(0, "<i4")
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=MEGATRON_HEADER_BYTES + 4 * seqs,
                         shape=(seqs,)) if seqs else np.zeros(0, "<i8")
    doc_idx = np.memmap(idx, dtype="<i8", mode="r", offset=MEGATRON_HEADER_BYTES + 12 * seqs,
                        shape=(docs,)) if docs else np.zeros(0, "<i8")
    if docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != seqs or np.any(np.diff(doc_idx) < 0):
        _fail(source, idx, f"has document indices that do not run from 0 up to its {seqs} "
              "sequences", _REWRITE)
    return np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<"), sizes, pointers


def open_megatron(idx: str | Path, source: str = "<job>") -> np.ndarray:
    """The token stream of a Megatron indexed dataset (module docstring), memory-mapped."""
    idx = Path(idx).expanduser()
    dtype, sizes, pointers = _megatron_index(idx, source)
    if np.any(sizes < 0):
        _fail(source, idx, "has a negative sequence size", _REWRITE)
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=starts[1:])
    if not np.array_equal(pointers, starts * dtype.itemsize):
        _fail(source, idx, "has sequences that do not lie in order and without gaps in its .bin "
              "(the stream would need a copy)", _REWRITE)
    total = int(starts[-1] + sizes[-1]) if len(sizes) else 0
    if total == 0:
        _fail(source, idx, "indexes no tokens", "give a dataset with documents in it")
    data = idx.with_suffix(".bin")
    size = _size(data, source)
    if size != total * dtype.itemsize:
        _fail(source, data, f"has {size} bytes, but {idx} indexes {total} {dtype.name} tokens "
              f"({total * dtype.itemsize} bytes)", "give the .bin and the .idx that were "
              "written together (by one run of Megatron-LM's tools/preprocess_data.py)")
    return np.memmap(data, dtype=dtype, mode="r", shape=(total,))


def open_pretokenized(path: str | Path, dtype: str | None, source: str = "<job>") -> np.ndarray:
    """The token stream of `data.tokens`, in the format its suffix names (module docstring;
    DataConfig.check admits no other suffix, and a .bin only with its dtype)."""
    kind = FORMATS[Path(path).suffix]
    if kind == "bin":
        return open_flat(path, dtype, source)
    return open_npy(path, source) if kind == "npy" else open_megatron(path, source)
