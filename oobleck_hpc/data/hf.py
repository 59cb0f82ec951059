"""A Hugging Face tokenizer for text corpora: `data.tokenizer: DIR`, DIR holding the
`tokenizer.json` that `save_pretrained` (or `tokenizers.Tokenizer.save`) writes. The only
module that imports the `tokenizers` library, an optional dependency (`pip install
'oobleck_hpc[hf]'`), and only when a job names a tokenizer.

- Vocabulary size: one more than the largest id of the vocabulary, added tokens included (the
  model's vocabulary must hold every id; a larger, padded model vocabulary is fine).
- End of sequence: the `eos_token` of DIR/tokenizer_config.json when that file exists and names
  one (as transformers writes it: a string or {"content": ...}); the corpus's files are then
  joined with that one token. Without one, files are joined with the tokens of "\\n\\n", as the
  byte-level tokenizer joins them.
- Each file is decoded as UTF-8 (an invalid byte becomes U+FFFD) and encoded without the
  tokenizer's own special tokens (no BOS/EOS added per file; the joins above are ours). Added
  tokens written literally in the text are matched, as the library does.
- Identity (part of the cache key, data/text.py): SHA-256 of tokenizer.json and
  tokenizer_config.json, so a changed tokenizer tokenises the corpus anew.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oobleck_hpc.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_KEY = "data.tokenizer"


@dataclass
class HFTokenizer:
    """A loaded Hugging Face tokenizer (module docstring); `load` validates the directory."""

    directory: Path
    tokenizer: Any  # tokenizers.Tokenizer
    vocab_size: int
    eos_id: int | None
    identity: str

    @classmethod
    def load(cls, directory: str | Path, source: str = "<job>") -> HFTokenizer:
        directory = Path(directory).expanduser()
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(source, _KEY, f"value {str(directory)!r} holds no {TOKENIZER_FILE} "
                              f"({path} is missing)", "point it at the directory where "
                              "save_pretrained wrote the model's tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ConfigError(source, _KEY, f"value {str(directory)!r} needs the optional "
                              "'tokenizers' package, which is not installed",
                              "pip install 'oobleck_hpc[hf]' (or pip install tokenizers)") from e
        raw = path.read_bytes()
        try:
            tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises plain Exceptions for any malformed file
            raise ConfigError(source, _KEY, f"file {path} is not a tokenizer the tokenizers "
                              f"library reads ({e})", "save it again with save_pretrained or "
                              "tokenizers.Tokenizer.save") from e
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ConfigError(source, _KEY, f"file {path} has an empty vocabulary",
                              "use the tokenizer the model was trained with")
        config = directory / CONFIG_FILE
        config_raw = config.read_bytes() if config.is_file() else b""
        eos = _eos_token(config, config_raw, source)
        eos_id = None
        if eos is not None:
            eos_id = tokenizer.token_to_id(eos)
            if eos_id is None:
                raise ConfigError(source, _KEY, f"file {config} names eos_token {eos!r}, which is "
                                  f"not in the vocabulary of {path}", "correct eos_token, or "
                                  "save tokenizer and config together with save_pretrained")
        identity = "hf-v1:" + hashlib.sha256(raw + b"\0" + config_raw).hexdigest()[:20]
        size = max(max(vocab.values()) + 1, tokenizer.get_vocab_size(with_added_tokens=True))
        return cls(directory, tokenizer, size, eos_id, identity)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)

    def encode_files(self, contents: list[bytes]) -> list[np.ndarray]:
        texts = [data.decode("utf-8", errors="replace") for data in contents]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def separator(self) -> np.ndarray:
        if self.eos_id is not None:
            return np.array([self.eos_id], dtype=np.int64)
        return self.encode("\n\n")


def _eos_token(config: Path, raw: bytes, source: str) -> str | None:
    """The eos_token that tokenizer_config.json names, if the file exists and names one."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(source, _KEY, f"file {config} is not JSON ({e})",
                          "save the tokenizer again with save_pretrained, or remove the file") from e
    eos = doc.get("eos_token") if isinstance(doc, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise ConfigError(source, _KEY, f"file {config} has an eos_token of type "
                          f"{type(eos).__name__}", "write it as a string, e.g. \"</s>\"")
    return eos
