"""Samples for the engine: fixed-length windows of the job's token stream, as torch tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from oobleck_hpc.config import DataConfig
from oobleck_hpc.data.stream import TokenStream, prepare_data

if TYPE_CHECKING:
    from oobleck_hpc.models.interface import LayerModel


@dataclass
class TokenDataset:
    """Fixed-length next-token samples from a token stream (data/__init__.py, "Samples"):
    the text cache file at `path` (`kind` "cache"), or a pre-tokenized file (`kind` "tokens",
    `dtype` for a flat .bin)."""

    path: str | Path
    seq_len: int
    kind: Literal["cache", "tokens"] = "cache"
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        self.tokens = TokenStream(str(self.path), self.kind, self.dtype).open()
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"{self.path} holds {len(self.tokens)} tokens, fewer than one sample "
                             f"of seq_len {self.seq_len} + 1; use a larger corpus or a shorter seq_len")

    def __getstate__(self) -> dict:  # processes re-map the file, not copy it
        return {"path": self.path, "seq_len": self.seq_len, "kind": self.kind, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.path, self.seq_len = state["path"], state["seq_len"]
        self.kind, self.dtype = state["kind"], state["dtype"]
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


def dataset_for(data: DataConfig, model: LayerModel, source: str = "<job>") -> TokenDataset:
    """The job's dataset for `model`: checked against its vocabulary, tokenised (once) if text,
    and opened. Samples of data.seq_len tokens, else the model's context length. `source` (the
    job file) is named in error messages."""
    seq_len = data.seq_len or model.seq_len
    stream = prepare_data(data, model.vocab_size, seq_len, source)
    return TokenDataset(stream.path, seq_len, stream.kind, stream.dtype)
