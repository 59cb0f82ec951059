"""Byte tokenizer, token-file cache and TokenDataset."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from oobleck_hpc import data
from oobleck_hpc.config import DataConfig, ModelConfig
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.models.base import build_model


def test_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return 'héllo'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_user_directory_corpus_and_samples(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_bytes(b"BBBB")
    (corpus / "a.txt").write_bytes(b"0123456789")
    (corpus / "sub" / "c.txt").write_bytes(b"cc")
    (corpus / ".hidden").write_bytes(b"never")
    cfg = DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache"))
    path = data.prepare_tokens(cfg)
    tokens = data.open_tokens(path)
    assert bytes(tokens) == b"0123456789\n\nBBBB\n\ncc"  # sorted by relative path
    ds = data.TokenDataset(path, seq_len=4)
    assert len(ds) == (len(tokens) - 1) // 4
    x, y = ds.sample(1)
    assert x.dtype == torch.int64 and x.tolist() == list(b"4567") and y.tolist() == list(b"5678")
    xb, yb = ds.batch([0, 1])
    assert xb.shape == (2, 4) and torch.equal(xb[1], x)
    with pytest.raises(IndexError):
        ds.sample(len(ds))
    import pickle
    assert set(ds.__getstate__()) == {"path", "seq_len", "kind", "dtype"}  # without the tokens
    loaded = pickle.loads(pickle.dumps(ds))
    assert isinstance(loaded.tokens, np.memmap) and torch.equal(loaded.sample(1)[1], y)  # re-mapped
    # cached: same file, not rewritten
    mtime = path.stat().st_mtime_ns
    assert data.prepare_tokens(cfg) == path and path.stat().st_mtime_ns == mtime
    # a changed corpus gets a new key
    (corpus / "a.txt").write_bytes(b"changed content")
    assert data.prepare_tokens(cfg) != path


def test_damaged_cache_file_is_rebuilt(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world " * 10)
    cfg = DataConfig(corpus=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "cache"))
    path = data.prepare_tokens(cfg)
    good = path.read_bytes()
    path.write_bytes(good[:-5])  # truncated
    with pytest.raises(ValueError, match="not a complete token file"):
        data.open_tokens(path)
    assert data.prepare_tokens(cfg) == path and path.read_bytes() == good


def test_bad_corpus_path(tmp_path):
    with pytest.raises(ConfigError, match="data.corpus.*neither 'stdlib' nor an existing"):
        data.prepare_tokens(DataConfig(corpus=str(tmp_path / "nope"), cache_dir=str(tmp_path)))


def _prepare(cfg, q):
    q.put(str(data.prepare_tokens(cfg)))


@pytest.mark.timeout(120)
def test_stdlib_corpus_deterministic_and_shared(tmp_path):
    """Two processes tokenise the bundled corpus at once: one file, same samples everywhere."""
    cfg = DataConfig(corpus="stdlib", cache_dir=str(tmp_path / "cache"))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(cfg, q)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        paths = {q.get(timeout=100) for _ in procs}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert len(paths) == 1
    path = paths.pop()
    assert sorted(x.name for x in (tmp_path / "cache").iterdir()) == [
        f".{path.rsplit('/', 1)[1]}.lock", path.rsplit("/", 1)[1]]
    ds = data.TokenDataset(path, seq_len=64)
    assert len(ds) > 100_000  # ~30 MB of real source text
    x, y = ds.sample(12345)
    assert torch.equal(x[1:], y[:-1])
    gpt_tiny = build_model(ModelConfig(name="gpt-tiny"))  # seq_len 64
    assert data.dataset_for(cfg, gpt_tiny).sample(12345)[0].tolist() == x.tolist()
    text = data.ByteTokenizer().decode(data.open_tokens(path)[:2000])
    assert "import" in text or "def " in text or '"""' in text
