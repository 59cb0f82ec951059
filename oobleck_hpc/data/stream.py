"""The job's token stream: where it lies, and whether it fits the model.

`check_data` is the launcher's pre-flight (no node started yet): the corpus exists, the
tokenizer loads and its vocabulary fits the model's, a pre-tokenized file parses, holds at
least one sample and every id in it fits the model's vocabulary. `prepare_data` is what every
worker does (data/dataset.py's `dataset_for`): the same checks, then the text corpus tokenised
into the cache once; it returns the `TokenStream` to memory-map.

A token id fits when 0 <= id < the model's vocabulary size (`LayerModel.vocab_size`); a
tokenizer fits when its vocabulary is no larger than the model's (a padded model vocabulary, as
Megatron pads GPT-2's 50,257 to 50,304, is fine). For a pre-tokenized file the smallest and
largest id are found by one scan of the memory map (skipped when the file's type cannot hold
an id beyond the model's), remembered in `data.cache_dir` as `range-<key>.txt` ("MIN MAX";
key = SHA-256 of the files' paths, sizes, modification times and the token type), so the ranks
of a node and later runs read the answer instead of scanning again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from oobleck_hpc.config import DataConfig
from oobleck_hpc.data.pretokenized import open_pretokenized
from oobleck_hpc.data.text import Tokenizer, corpus_files, open_tokens, prepare_tokens, text_tokenizer
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.files import write_atomic

_SCAN_CHUNK = 1 << 26  # tokens per min/max pass (128 MiB of uint16)


@dataclass(frozen=True)
class TokenStream:
    """A token stream to memory-map: the text cache (`kind` "cache", data/text.py) or the job's
    pre-tokenized file (`kind` "tokens", data/pretokenized.py; `dtype`: data.dtype)."""

    path: str
    kind: Literal["cache", "tokens"] = "cache"
    dtype: str | None = None

    def open(self, source: str = "<job>") -> np.ndarray:
        if self.kind == "cache":
            return open_tokens(self.path)
        return open_pretokenized(self.path, self.dtype, source)


def check_data(data: DataConfig, vocab_size: int, seq_len: int, source: str = "<job>") -> None:
    """Pre-flight: everything `prepare_data` would reject, short of tokenising a text corpus."""
    if data.tokens is None:
        _fitting_tokenizer(data, vocab_size, source)
        corpus_files(data.corpus, source)
    else:
        _check_pretokenized(data, vocab_size, seq_len, source)


def prepare_data(data: DataConfig, vocab_size: int, seq_len: int, source: str = "<job>"
                 ) -> TokenStream:
    """The job's token stream, checked against a model of `vocab_size` ids and samples of
    `seq_len` tokens; a text corpus is tokenised into the cache now unless it is there."""
    if data.tokens is not None:
        _check_pretokenized(data, vocab_size, seq_len, source)
        return TokenStream(data.tokens, "tokens", data.dtype)
    path = prepare_tokens(data, source, _fitting_tokenizer(data, vocab_size, source))
    _check_length(len(open_tokens(path)), seq_len, "data.corpus", path, source)
    return TokenStream(str(path), "cache")


def _fitting_tokenizer(data: DataConfig, vocab_size: int, source: str) -> Tokenizer:
    tokenizer = text_tokenizer(data, source)
    if tokenizer.vocab_size > vocab_size:
        what = (f"value {data.tokenizer!r} has" if data.tokenizer is not None else
                "is unset: the byte-level tokenizer has")
        raise ConfigError(source, "data.tokenizer", f"{what} {tokenizer.vocab_size} token ids, "
                          f"more than the model's vocabulary of {vocab_size}",
                          "use the tokenizer the model was made for, or a model whose "
                          f"vocabulary holds at least {tokenizer.vocab_size} ids")
    return tokenizer


def _check_pretokenized(data: DataConfig, vocab_size: int, seq_len: int, source: str) -> None:
    if data.tokenizer is not None:  # named beside the tokens: it must fit too
        _fitting_tokenizer(data, vocab_size, source)
    tokens = open_pretokenized(data.tokens, data.dtype, source)
    path = Path(data.tokens).expanduser()
    _check_length(len(tokens), seq_len, "data.tokens", path, source)
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return  # no value of this type lies outside the vocabulary
    files = [path, path.with_suffix(".bin")] if path.suffix == ".idx" else [path]
    lo, hi = token_range(tokens, files, Path(data.cache_dir).expanduser())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ConfigError(source, "data.tokens", f"file {path} holds the token id {bad}, outside "
                          f"the model's vocabulary of {vocab_size} ids (0..{vocab_size - 1})",
                          "use tokens made with the model's tokenizer, or a model whose "
                          f"vocabulary holds ids up to {hi}")


def _check_length(n: int, seq_len: int, key: str, path: Path, source: str) -> None:
    if n < seq_len + 1:
        raise ConfigError(source, key, f"file {path} holds {n} tokens, fewer than one sample of "
                          f"seq_len {seq_len} + 1", "use more data or a shorter data.seq_len")


def token_range(tokens: np.ndarray, files: list[Path], cache_dir: Path) -> tuple[int, int]:
    """(smallest, largest) id in `tokens`, the memory map of `files`: read from the record in
    `cache_dir` when one matches the files as they are now, else scanned and recorded."""
    h = hashlib.sha256(tokens.dtype.str.encode())
    for p in files:
        st = p.stat()
        h.update(f"|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    record = cache_dir / f"range-{h.hexdigest()[:20]}.txt"
    try:
        lo, hi = (int(x) for x in record.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        pass  # none yet (or unreadable): scan
    lo, hi = int(tokens[0]), int(tokens[0])
    for start in range(0, len(tokens), _SCAN_CHUNK):
        part = tokens[start:start + _SCAN_CHUNK]
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(record, f"{lo} {hi}\n")
    return lo, hi
