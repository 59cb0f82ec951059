"""Training data: a byte-level tokenizer, a bundled corpus that needs no network, and a
memory-mapped token file that is written once and reused by every run and every node.

Tokenizer. Byte-level: token = byte value, vocabulary 256, no merges, no download. Every file is
encoded as its raw bytes (so any text, any encoding) and files are joined with `SEPARATOR`.

Corpus. `corpus: stdlib` is the `.py` files of the running Python's standard library (real,
human-written text that is on every machine: ~1,800 files, ~30 MB on CPython 3.11), without
site-packages/dist-packages. A user path is a file or a directory (all regular files under it,
hidden ones skipped). Files are taken in sorted relative-path order, so the token stream is the
same on every node.

Cache. The token stream is stored once as `<cache_dir>/tokens-<key>.bin`:

    bytes 0..7    magic b"OOBTOK1\\0"
    bytes 8..15   dtype code (ASCII, NUL padded): "uint8" when the vocabulary fits, else "uint16"
    bytes 16..23  number of tokens, little-endian uint64
    bytes 24..    the tokens

`key` = SHA-256 of (tokenizer version, corpus kind, the sorted list of (relative path, size,
mtime)) -- the corpus identity without reading its contents. The file is written to a
temporary name in the same directory, fsync'ed and renamed (atomic), under an advisory lock so
that the ranks of one node tokenise once; the lock only saves work: correctness comes from the
atomic rename (concurrent writers produce the same bytes). Readers `np.memmap` it, so 8 workers
on a node share one copy in the page cache.

Samples. `TokenDataset(path, seq_len)` cuts the stream into non-overlapping windows of
`seq_len + 1` tokens starting at multiples of `seq_len`: sample i is
x = tokens[i*T : i*T + T], y = tokens[i*T + 1 : i*T + T + 1] (next-token targets), both int64.
`len = (n_tokens - 1) // T`. Sampling order is the engine's business (`sample(i)` is pure).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oobleck_hpc.config import DataConfig
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.files import atomic_open

TOKENIZER_VERSION = "bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = b"\n\n"
MAGIC = b"OOBTOK1\0"
HEADER_BYTES = 24
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class ByteTokenizer:
    """Token = byte. `decode` is lossless for any bytes; text is decoded as UTF-8 (replacing
    invalid sequences) only for display."""

    vocab_size = VOCAB_SIZE
    version = TOKENIZER_VERSION

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(corpus: str, source: str = "<job>") -> tuple[Path, list[Path]]:
    """(root, files in sorted order) of a corpus: 'stdlib' or a file / directory path."""
    if corpus == "stdlib":
        root = stdlib_dir()
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    else:
        root = Path(corpus).expanduser()
        if root.is_file():
            return root.parent, [root]
        if not root.is_dir():
            raise ConfigError(source, "data.corpus", f"value {corpus!r} is neither 'stdlib' nor an "
                              "existing file or directory", "use 'stdlib' or the path of your text")
        files = [p for p in root.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise ConfigError(source, "data.corpus", f"value {corpus!r} holds no files",
                          "point it at a text file or a directory with text files")
    return root, files


def corpus_key(corpus: str, root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    kind = "stdlib" if corpus == "stdlib" else "path"
    h.update(f"{TOKENIZER_VERSION}|{kind}|{len(files)}\n".encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _write_token_file(path: Path, files: list[Path]) -> None:
    dtype = np.uint8 if VOCAB_SIZE <= 256 else np.uint16
    with atomic_open(path, durable=True) as out:
        out.write(MAGIC + np.dtype(dtype).name.encode().ljust(8, b"\0") + struct.pack("<Q", 0))
        n = 0
        for i, p in enumerate(files):
            data = p.read_bytes()  # byte-level tokenizer: the bytes are the tokens
            if i:
                out.write(SEPARATOR)
                n += len(SEPARATOR)
            out.write(np.frombuffer(data, dtype=np.uint8).astype(dtype, copy=False).tobytes())
            n += len(data)
        out.seek(16)
        out.write(struct.pack("<Q", n))


def prepare_tokens(data: DataConfig, source: str = "<job>") -> Path:
    """The token file of `data.corpus`, tokenised now if no valid one is in `data.cache_dir`.
    `source` (the job file) is named in error messages."""
    root, files = corpus_files(data.corpus, source)
    cache = Path(data.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"tokens-{corpus_key(data.corpus, root, files)}.bin"
    if _valid(path):
        return path
    with open(cache / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks of one node wait for the first one's file
        try:
            if not _valid(path):
                _write_token_file(path, files)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _valid(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) != HEADER_BYTES or head[:8] != MAGIC:
            return False
        (n,) = struct.unpack("<Q", head[16:24])
        itemsize = np.dtype(head[8:16].rstrip(b"\0").decode()).itemsize
        return path.stat().st_size == HEADER_BYTES + n * itemsize
    except (OSError, TypeError, ValueError):
        return False


def open_tokens(path: str | Path) -> np.ndarray:
    """The token file as a read-only memory map."""
    path = Path(path)
    if not _valid(path):
        raise ValueError(f"{path} is not a complete token file (bad header or size). Fix: delete "
                         f"it; the next run re-creates it from the corpus")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    dtype = np.dtype(head[8:16].rstrip(b"\0").decode())
    (n,) = struct.unpack("<Q", head[16:24])
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


@dataclass
class TokenDataset:
    """Fixed-length next-token samples from a token file (see the module docstring)."""

    path: str | Path
    seq_len: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        self.tokens = open_tokens(self.path)
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one sample "
                             f"of seq_len {self.seq_len} + 1; use a larger corpus or a shorter seq_len")

    def __getstate__(self) -> dict:
        return {"path": self.path, "seq_len": self.seq_len}  # processes re-map the file, not copy it

    def __setstate__(self, state: dict) -> None:
        self.path, self.seq_len = state["path"], state["seq_len"]
        self.__post_init__()

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 tensors of shape (seq_len,); y is x shifted left by one token."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        start = i * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked samples: (x, y) of shape (len(indices), seq_len)."""
        xs, ys = zip(*(self.sample(int(i)) for i in indices))
        return torch.stack(xs), torch.stack(ys)


def dataset_for(data: DataConfig, seq_len: int, source: str = "<job>") -> TokenDataset:
    """The job's dataset: tokenise (once) and open. `seq_len`: data.seq_len, else this (the
    model's context length). `source` (the job file) is named in error messages."""
    return TokenDataset(prepare_tokens(data, source), data.seq_len or seq_len)
