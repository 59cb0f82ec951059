"""The global sampler: the same sequence of global batches whatever the plan.

The training stream is an endless sequence of dataset indices: position j lies in epoch
e = j // N (N = len(dataset)) and maps to perm_e[j % N], a permutation drawn from (seed, e).
Step s consumes the positions [cursor, cursor + B) with B = global_microbatches x
microbatch_size; the cursor (samples consumed) is training state and advances only when a
step commits. Inside a step, global microbatch g holds positions cursor + g*b ... + (g+1)*b - 1
(b = microbatch_size); pipeline p takes the microbatches [offset_p, offset_p + m_p) where
offset_p = sum of the microbatch counts of the pipelines before it, and a GPU of a multi-GPU
stage takes its rows of each microbatch. So a re-split of the batch across different pipelines
changes who computes a sample, never which samples form a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class SyntheticTokens:
    """Random token samples, deterministic per index: for tests and benchmarks that need no
    corpus. Sample i = tokens drawn from a generator seeded by (seed, i); y = x shifted by one."""

    vocab_size: int
    seq_len: int
    seed: int = 0
    size: int = 1 << 20

    def __len__(self) -> int:
        return self.size

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=g)
        return t[:-1], t[1:]


@dataclass
class GlobalSampler:
    dataset: Dataset
    microbatch_size: int
    global_microbatches: int
    seed: int = 0
    _perm: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.global_microbatches

    def index(self, position: int) -> int:
        n = len(self.dataset)
        epoch, offset = divmod(position, n)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7_919 + epoch)
            self._perm = (epoch, torch.randperm(n, generator=g))
        return int(self._perm[1][offset])

    def microbatch(self, cursor: int, microbatch: int, rows: tuple[int, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of global microbatch `microbatch` of the step starting at `cursor`, rows
        [start, end) of it (default: all)."""
        r0, r1 = rows or (0, self.microbatch_size)
        base = cursor + microbatch * self.microbatch_size
        xs, ys = zip(*(self.dataset.sample(self.index(base + r)) for r in range(r0, r1)))
        return torch.stack(xs), torch.stack(ys)
