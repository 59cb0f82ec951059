"""Text corpora: the byte-level tokenizer, the bundled corpus, and the memory-mapped token cache
that a corpus is tokenised into once and that every run and every node reuses.

Tokenizer. Byte-level unless `data.tokenizer` names a Hugging Face tokenizer (data/hf.py):
token = byte value, vocabulary 256, no merges, no download. Every file is encoded as its raw
bytes (so any text, any encoding) and files are joined with `SEPARATOR`.

Corpus. `corpus: stdlib` is the `.py` files of the running Python's standard library (real,
human-written text that is on every machine: ~1,800 files, ~30 MB on CPython 3.11), without
site-packages/dist-packages. A user path is a file or a directory (all regular files under it,
hidden ones skipped). Files are taken in sorted relative-path order, so the token stream is the
same on every node.

Cache. The token stream is stored once as `<cache_dir>/tokens-<key>.bin`:

    bytes 0..7    magic b"OOBTOK1\\0"
    bytes 8..15   dtype code (ASCII, NUL padded): the smallest of "uint8", "uint16", "uint32"
                  that holds every id of the tokenizer's vocabulary
    bytes 16..23  number of tokens, little-endian uint64
    bytes 24..    the tokens

`key` = SHA-256 of (the tokenizer's identity -- "bytes-v1", or a hash of the Hugging Face
tokenizer's files --, corpus kind, the sorted list of (relative path, size, mtime)) -- the
corpus identity without reading its contents. The file is written to a temporary name in the
same directory, fsync'ed and renamed (atomic), under an advisory lock so that the ranks of one
node tokenise once; the lock only saves work: correctness comes from the atomic rename
(concurrent writers produce the same bytes). Readers `np.memmap` it, so 8 workers on a node
share one copy in the page cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from oobleck_hpc.config import DataConfig
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.files import atomic_open

if TYPE_CHECKING:
    from oobleck_hpc.data.hf import HFTokenizer

TOKENIZER_VERSION = "bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = b"\n\n"
MAGIC = b"OOBTOK1\0"
HEADER_BYTES = 24
CACHE_DTYPES = ("uint8", "uint16", "uint32")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_BATCH_BYTES = 8 << 20  # files handed to the tokenizer at once (a Hugging Face one in parallel)


class Tokenizer(Protocol):
    """What the cache writer needs of a tokenizer (ByteTokenizer, data/hf.py's HFTokenizer)."""

    vocab_size: int
    identity: str

    def encode_files(self, contents: list[bytes]) -> list[np.ndarray]: ...

    def separator(self) -> np.ndarray: ...


class ByteTokenizer:
    """Token = byte. `decode` is lossless for any bytes; text is decoded as UTF-8 (replacing
    invalid sequences) only for display."""

    vocab_size = VOCAB_SIZE
    identity = TOKENIZER_VERSION

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def encode_files(self, contents: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(data, dtype=np.uint8) for data in contents]

    def separator(self) -> np.ndarray:
        return np.frombuffer(SEPARATOR, dtype=np.uint8)


def text_tokenizer(data: DataConfig, source: str = "<job>") -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `data`: byte-level, or the Hugging Face one `data.tokenizer` names."""
    if data.tokenizer is None:
        return ByteTokenizer()
    from oobleck_hpc.data.hf import HFTokenizer

    return HFTokenizer.load(data.tokenizer, source)


def cache_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds the ids 0 .. vocab_size - 1."""
    for name in CACHE_DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return np.dtype(name)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit in uint32")


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


def corpus_key(corpus: str, root: Path, files: list[Path], tokenizer: str = TOKENIZER_VERSION) -> str:
    """The cache key of `files` tokenised by the tokenizer whose identity is `tokenizer`."""
    h = hashlib.sha256()
    kind = "stdlib" if corpus == "stdlib" else "path"
    h.update(f"{tokenizer}|{kind}|{len(files)}\n".encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _batches(files: list[Path]) -> Iterator[list[Path]]:
    batch, size = [], 0
    for p in files:
        batch.append(p)
        size += p.stat().st_size
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_token_file(path: Path, files: list[Path], tokenizer: Tokenizer) -> None:
    dtype = cache_dtype(tokenizer.vocab_size)
    separator = tokenizer.separator().astype(dtype)
    with atomic_open(path, durable=True) as out:
        out.write(MAGIC + dtype.name.encode().ljust(8, b"\0") + struct.pack("<Q", 0))
        n = 0
        for batch in _batches(files):
            for ids in tokenizer.encode_files([p.read_bytes() for p in batch]):
                if n:
                    out.write(separator.tobytes())
                    n += len(separator)
                out.write(ids.astype(dtype, copy=False).tobytes())
                n += len(ids)
        out.seek(16)
        out.write(struct.pack("<Q", n))


def prepare_tokens(data: DataConfig, source: str = "<job>", tokenizer: Tokenizer | None = None
                   ) -> Path:
    """The token file of `data.corpus`, tokenised now if no valid one is in `data.cache_dir`.
    `tokenizer`: `text_tokenizer(data)` when not given. `source` (the job file) is named in
    error messages."""
    tokenizer = text_tokenizer(data, source) if tokenizer is None else tokenizer
    root, files = corpus_files(data.corpus, source)
    cache = Path(data.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"tokens-{corpus_key(data.corpus, root, files, tokenizer.identity)}.bin"
    if _header(path) is not None:
        return path
    with open(cache / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks of one node wait for the first one's file
        try:
            if _header(path) is None:
                _write_token_file(path, files, tokenizer)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _header(path: Path) -> tuple[np.dtype, int] | None:
    """(dtype, number of tokens) of a complete token file, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) != HEADER_BYTES or head[:8] != MAGIC:
            return None
        name = head[8:16].rstrip(b"\0").decode("ascii")
        if name not in CACHE_DTYPES:
            return None
        (n,) = struct.unpack("<Q", head[16:24])
        dtype = np.dtype(name)
        return (dtype, n) if path.stat().st_size == HEADER_BYTES + n * dtype.itemsize else None
    except (OSError, UnicodeDecodeError):
        return None


def open_tokens(path: str | Path) -> np.ndarray:
    """The token file as a read-only memory map."""
    path = Path(path)
    header = _header(path)
    if header is None:
        raise ValueError(f"{path} is not a complete token file (bad header or size). Fix: delete "
                         f"it; the next run re-creates it from the corpus")
    dtype, n = header
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
