"""Training data: text corpora tokenised once into a memory-mapped cache, or pre-tokenized
files used in place; both checked against the model's vocabulary before anything starts.

The job file's `data` section (`DataConfig`, configs/training.py):

    data:
      corpus: stdlib          # text: 'stdlib' (bundled, no download), a file or a directory
      tokenizer: hf-tok/      # optional: a directory with a Hugging Face tokenizer.json
                              #   (pip install 'oobleck_hpc[hf]'); unset: byte-level, 256 ids
      seq_len: 64             # optional: tokens per sample (default: the model's context)
      cache_dir: .cache/oobleck_hpc

    data:
      tokens: train.bin       # pre-tokenized, instead of corpus: FILE.bin (flat, as nanoGPT
      dtype: uint16           #   writes it; dtype uint16 or uint32 required), FILE.npy, or
                              #   PREFIX.idx of a Megatron-LM indexed dataset (PREFIX.bin beside)

Modules:

- `text.py`          the byte-level tokenizer, corpora (stdlib, a path) and the token cache file;
- `hf.py`            a Hugging Face tokenizer (the only module importing `tokenizers`);
- `pretokenized.py`  flat .bin, .npy and Megatron .bin/.idx, memory-mapped (their layouts);
- `stream.py`        the job's token stream and its checks: the launcher's pre-flight
                     (`check_data`) and every worker's (`prepare_data`);
- `dataset.py`       `TokenDataset` and `dataset_for(data, model)` (torch).

A token id must lie in 0 .. vocab_size - 1 of the model, and a tokenizer's vocabulary must be
no larger than the model's: otherwise the job exits 2 (ConfigError) naming the file and the fix.

Samples. `TokenDataset(path, seq_len)` cuts the stream into non-overlapping windows of
`seq_len + 1` tokens starting at multiples of `seq_len`: sample i is
x = tokens[i*T : i*T + T], y = tokens[i*T + 1 : i*T + T + 1] (next-token targets), both int64.
`len = (n_tokens - 1) // T`. Sampling order is the engine's business (`sample(i)` is pure). The
same tokens give the same samples whichever file they come from.

The torch-backed names (`TokenDataset`, `dataset_for`) are imported on first use, so the
launcher's pre-flight does not import torch.
"""

from oobleck_hpc.data.stream import TokenStream, check_data, prepare_data
from oobleck_hpc.data.text import (
    ByteTokenizer,
    corpus_files,
    corpus_key,
    open_tokens,
    prepare_tokens,
    stdlib_dir,
    text_tokenizer,
)

_LAZY = {"TokenDataset", "dataset_for"}


def __getattr__(name: str):
    if name in _LAZY:
        from oobleck_hpc.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'oobleck_hpc.data' has no attribute {name!r}")


__all__ = ["ByteTokenizer", "TokenDataset", "TokenStream", "check_data", "corpus_files",
           "corpus_key", "dataset_for", "open_tokens", "prepare_data", "prepare_tokens",
           "stdlib_dir", "text_tokenizer"]
