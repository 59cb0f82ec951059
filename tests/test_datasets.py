"""Pre-tokenized datasets (flat .bin, .npy, Megatron .bin/.idx), the Hugging Face tokenizer,
and the vocabulary checks (issue 29, item 4). The files are written here from the layouts the
formats document (oobleck_hpc/data/pretokenized.py), not by our own reader's code."""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from oobleck_hpc import cli, data
from oobleck_hpc.config import DataConfig, JobConfig, ModelConfig, TrainConfig, job_from_dict
from oobleck_hpc.data.text import cache_dtype
from oobleck_hpc.engine import reference_run
from oobleck_hpc.errors import ConfigError
from oobleck_hpc.models.base import build_model

GPT_TINY = build_model(ModelConfig(name="gpt-tiny"))  # vocabulary 256, context 64
RNG = np.random.default_rng(29)
TOKENS = RNG.integers(0, 256, size=64 * 16 + 1).tolist()  # 16 samples of gpt-tiny


def write_flat(path, tokens, dtype="<u2"):
    """nanoGPT's prepare.py: the ids back to back, no header."""
    path.write_bytes(np.asarray(tokens, dtype=dtype).tobytes())
    return path


def write_megatron(prefix, docs, code=8, modes=False):
    """Megatron-LM's MMIDIDX layout, one sequence per document: PREFIX.bin and PREFIX.idx."""
    dtype = {1: "u1", 4: "<i4", 5: "<i8", 8: "<u2"}[code]
    itemsize = np.dtype(dtype).itemsize
    sizes = [len(d) for d in docs]
    pointers = [sum(sizes[:i]) * itemsize for i in range(len(docs))]
    doc_idx = list(range(len(docs) + 1))  # 0, then where each document ends
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
           + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
           + np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
           + np.asarray(doc_idx, "<i8").tobytes() + (bytes(len(sizes)) if modes else b""))
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(d, dtype).tobytes() for d in docs))
    prefix.with_suffix(".idx").write_bytes(idx)
    return prefix.with_suffix(".idx")


def split(tokens, cuts):
    bounds = [0, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.fixture
def formats(tmp_path):
    """The same tokens as text (its bytes), a uint16 .bin, a uint32 .bin, an .npy and two
    Megatron datasets (uint16; int32 with the multimodal modes): name -> DataConfig."""
    cache = str(tmp_path / "cache")
    (tmp_path / "text.txt").write_bytes(bytes(TOKENS))
    np.save(tmp_path / "tokens.npy", np.asarray(TOKENS, dtype=np.int32))
    docs = split(TOKENS, [1, 100, 100, 101, 640])  # an empty document too
    return {
        "text": DataConfig(corpus=str(tmp_path / "text.txt"), cache_dir=cache),
        "bin16": DataConfig(tokens=str(write_flat(tmp_path / "train.bin", TOKENS)), dtype="uint16",
                            cache_dir=cache),
        "bin32": DataConfig(tokens=str(write_flat(tmp_path / "t32.bin", TOKENS, "<u4")),
                            dtype="uint32", cache_dir=cache),
        "npy": DataConfig(tokens=str(tmp_path / "tokens.npy"), cache_dir=cache),
        "megatron": DataConfig(tokens=str(write_megatron(tmp_path / "mg_text_document", docs)),
                               cache_dir=cache),
        "megatron32": DataConfig(tokens=str(write_megatron(tmp_path / "mg32", docs, code=4,
                                                           modes=True)), cache_dir=cache),
    }


def test_every_format_gives_the_samples_of_the_same_text(formats, tmp_path):
    expect = data.dataset_for(formats["text"], GPT_TINY)
    assert len(expect) == 16
    x, y = expect.batch(range(16))
    assert x.flatten().tolist() + [y[-1, -1].item()] == TOKENS
    for name, cfg in formats.items():
        ds = data.dataset_for(cfg, GPT_TINY)
        xs, ys = ds.batch(range(len(ds)))
        assert len(ds) == 16 and xs.equal(x) and ys.equal(y), name
        if name != "text":  # used in place: a memory map of the user's file, nothing copied
            assert isinstance(ds.tokens, np.memmap) and ds.kind == "tokens", name
            assert Path(ds.tokens.filename) == Path(cfg.tokens).with_suffix(
                ".npy" if name == "npy" else ".bin").resolve(), name  # Megatron: PREFIX.bin
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert len([n for n in cached if n.startswith("tokens-")]) == 1  # the text's only


def test_a_pretokenized_dataset_trains_to_the_losses_of_the_same_text(formats):
    """The single-process fp64 reference, 3 steps of gpt-tiny: identical losses whatever the
    file the tokens come from."""
    runs = {}
    for name in ("text", "bin16", "npy", "megatron"):
        job = JobConfig(model=ModelConfig(name="gpt-tiny"), data=formats[name],
                        train=TrainConfig(steps=3, microbatch_size=2, global_microbatches=2)).validate()
        runs[name] = reference_run(job, 3)[0]
    assert 4.5 < runs["text"][0] < 6.5 and len(set(runs["text"])) == 3  # ~ln 256, and it learns
    assert runs["bin16"] == runs["text"] and runs["npy"] == runs["text"]
    assert runs["megatron"] == runs["text"]


def _job_yaml(tmp_path, data_lines, launch: str = "local"):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: vocab\nrun_dir: {tmp_path / 'run'}\nmodel:\n  name: gpt-tiny\n"
                   f"data:\n{data_lines}cluster:\n  launch: {launch}\n  nodes: 1\n"
                   "  gpus_per_node: 1\n  device: cpu\n")
    return job


def test_a_token_id_beyond_the_vocabulary_exits_2_before_anything_starts(tmp_path, capsys):
    bad = write_flat(tmp_path / "big.bin", [5] * 100 + [300] + [7] * 100)
    data_lines = f"  tokens: {bad}\n  dtype: uint16\n  cache_dir: {tmp_path / 'c'}\n"
    for command, launch in (("run", "local"), ("submit", "slurm")):
        job = _job_yaml(tmp_path, data_lines, launch)
        assert cli.main([command, str(job)]) == 2
        err = capsys.readouterr().err
        assert f"key 'data.tokens': file {bad} holds the token id 300, outside the model's " \
               "vocabulary of 256 ids (0..255). Fix: " in err, (command, err)
        assert not (tmp_path / "run").exists()  # refused before the run began (or submitted)
    # The scan is remembered (keyed by the file as it is) and redone once the file changes.
    (record,) = (tmp_path / "c").glob("range-*.txt")
    assert record.read_text() == "5 300\n"
    write_flat(bad, [5] * 100 + [255] * 101)
    data.check_data(DataConfig(tokens=str(bad), dtype="uint16", cache_dir=str(tmp_path / "c")),
                    256, 64)
    assert sorted(r.read_text() for r in (tmp_path / "c").glob("range-*.txt")) == ["5 255\n", "5 300\n"]
    # A negative id (a signed type) is outside too.
    np.save(tmp_path / "neg.npy", np.asarray([3] * 80 + [-1], dtype=np.int16))
    with pytest.raises(ConfigError, match=r"neg.npy holds the token id -1, outside"):
        data.check_data(DataConfig(tokens=str(tmp_path / "neg.npy"), cache_dir=str(tmp_path)), 256, 64)
    # A type that cannot hold an id beyond the vocabulary is not scanned at all.
    ok = write_flat(tmp_path / "ok.bin", [1] * 70)
    data.check_data(DataConfig(tokens=str(ok), dtype="uint16", cache_dir=str(tmp_path / "d")),
                    65536, 64)
    assert not (tmp_path / "d").exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="data.tokenizer': is unset: the byte-level tokenizer "
                       "has 256 token ids, more than the model's vocabulary of 100"):
        data.check_data(DataConfig(), 100, 64)


def _raises(cfg, *words):
    with pytest.raises(ConfigError) as e:
        data.check_data(cfg, 256, 64, "job.yaml")
    assert "job.yaml: key 'data." in str(e.value) and "Fix: " in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_bad_pretokenized_files_are_explained(tmp_path):
    def bin16(name, payload):
        path = tmp_path / name
        path.write_bytes(payload)
        return DataConfig(tokens=str(path), dtype="uint16", cache_dir=str(tmp_path))

    _raises(bin16("odd.bin", bytes(129)), "odd.bin has 129 bytes, not a whole positive number of "
            "uint16 tokens", "check data.dtype")
    _raises(DataConfig(tokens=str(tmp_path / "none.bin"), dtype="uint16"), "none.bin does not exist")
    _raises(bin16("short.bin", bytes(20)), "short.bin holds 10 tokens, fewer than one sample of "
            "seq_len 64 + 1")
    np.save(tmp_path / "two_d.npy", np.zeros((2, 80), dtype=np.uint16))
    np.save(tmp_path / "float.npy", np.zeros(80, dtype=np.float32))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    for name, words in {"two_d.npy": "shape (2, 80)", "float.npy": "holds a float32 array",
                        "junk.npy": "is not a readable .npy array"}.items():
        _raises(DataConfig(tokens=str(tmp_path / name)), f"{name} ", words)


def _megatron_case(tmp_path, name, damage):
    idx = write_megatron(tmp_path / name, split(TOKENS, [300]))
    raw = bytearray(idx.read_bytes())
    damage(idx, raw)
    return DataConfig(tokens=str(idx), cache_dir=str(tmp_path))


def test_bad_megatron_datasets_are_explained(tmp_path):
    def put(offset, value):
        def damage(idx, raw):
            raw[offset:offset + len(value)] = value
            idx.write_bytes(bytes(raw))
        return damage

    cases = {
        "magic": (put(0, b"XXIDIDX"), "is not a Megatron-LM index (no MMIDIDX header)"),
        "version": (put(9, struct.pack("<Q", 2)), "has index version 2, not 1"),
        "float": (put(17, bytes([6])), "has dtype code 6, not an integer token type"),
        "count": (put(18, struct.pack("<Q", 3)), "but its header promises 3 sequences"),
        "truncated": (lambda idx, raw: idx.write_bytes(bytes(raw[:-8])), "bytes, but its header"),
        "gap": (put(34 + 8 + 8, struct.pack("<q", 602)), "do not lie in order and without gaps"),
        "docs": (put(34 + 8 + 16 + 8, struct.pack("<q", 5)), "document indices that do not run"),
        "negative": (put(34, struct.pack("<i", -1)), "negative sequence size"),
        "bin": (lambda idx, raw: idx.with_suffix(".bin").write_bytes(bytes(40)),
                "has 40 bytes, but"),
        "nobin": (lambda idx, raw: idx.with_suffix(".bin").unlink(), "does not exist"),
    }
    for name, (damage, words) in cases.items():
        _raises(_megatron_case(tmp_path, name, damage), f"{name}.", words)
    _megatron_case(tmp_path, "intact", lambda idx, raw: None)  # the writer's own file is good
    data.check_data(DataConfig(tokens=str(tmp_path / "intact.idx"), cache_dir=str(tmp_path)), 256, 64)


@pytest.mark.parametrize("text, key, words", [
    ("tokens: t.txt\n", "data.tokens", "none of the suffixes .bin, .npy, .idx"),
    ("tokens: t.bin\n", "data.dtype", "is required for a flat .bin"),
    ("tokens: t.npy\n  dtype: uint16\n", "data.dtype", "applies to a flat .bin in tokens only"),
    ("corpus: text/\n  tokens: t.npy\n", "data.tokens", "is given beside corpus 'text/'"),
    ("tokens: t.bin\n  dtype: int8\n", "data.dtype", "use one of: uint16, uint32"),
    ("tokenizer: 7\n", "data.tokenizer", "is not a string"),
    ("tokenz: t.bin\n", "data.tokenz", "valid keys here are: corpus, tokenizer, tokens, dtype"),
])
def test_bad_data_keys_are_explained(text, key, words):
    with pytest.raises(ConfigError) as e:
        job_from_dict(yaml.safe_load("data:\n  " + text), source="job.yaml")
    assert e.value.key == key and words in str(e.value) and "Fix: " in str(e.value), str(e.value)


def test_cache_dtype_by_vocabulary_size(tmp_path):
    assert [cache_dtype(n).name for n in (256, 257, 65536, 65537, 2**32)] == \
        ["uint8", "uint16", "uint16", "uint32", "uint32"]
    (tmp_path / "t.txt").write_bytes(b"x" * 100)
    cfg = DataConfig(corpus=str(tmp_path / "t.txt"), cache_dir=str(tmp_path / "c"))
    path = data.prepare_tokens(cfg)
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"float64\0"  # a type a token file never has, though numpy knows it
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="not a complete token file"):
        data.open_tokens(path)
    assert data.prepare_tokens(cfg) == path and data.open_tokens(path).dtype == np.uint8


# ------------------------------------------------------------------ Hugging Face tokenizer


SENTENCES = ["the quick brown fox jumps over the lazy dog", "pipelines of layers train on nodes",
             "a node dies and the job goes on", "héllo wörld, the end"]


def _tokenizer_dir(path, eos="<|endoftext|>"):
    """A byte-level BPE trained here on a few sentences (no download), saved as Hugging Face
    saves it: tokenizer.json, and tokenizer_config.json naming the end-of-sequence token."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 5, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if eos is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return path


def test_a_hugging_face_tokenizer_tokenises_the_corpus_once_into_the_cache(tmp_path):
    tok_dir = _tokenizer_dir(tmp_path / "tok")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(SENTENCES[0] + "\n" + SENTENCES[3])
    (corpus / "b.txt").write_text(SENTENCES[2])
    cfg = DataConfig(corpus=str(corpus), tokenizer=str(tok_dir), cache_dir=str(tmp_path / "c"))
    tok = data.text_tokenizer(cfg)
    assert 257 < tok.vocab_size <= 300 and tok.eos_id == tok.tokenizer.token_to_id("<|endoftext|>")
    stream = data.prepare_data(cfg, 50257, 8)  # gpt2-small's vocabulary
    tokens = data.open_tokens(stream.path)
    assert tokens.dtype == np.uint16  # more than 256 ids
    eos = list(tokens).index(tok.eos_id)
    assert tok.decode(tokens[:eos]) == SENTENCES[0] + "\n" + SENTENCES[3]  # decodes back
    assert tok.decode(tokens[eos + 1:]) == SENTENCES[2] and list(tokens).count(tok.eos_id) == 1
    assert len(tokens) < len((corpus / "a.txt").read_bytes()) + 1 + len(SENTENCES[2])  # merges
    # Once: the same file next time; the tokenizer's identity is in the key.
    mtime = Path(stream.path).stat().st_mtime_ns
    assert data.prepare_data(cfg, 50257, 8) == stream and Path(stream.path).stat().st_mtime_ns == mtime
    assert data.prepare_data(DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "c")),
                             256, 8).path != stream.path
    config = tok_dir / "tokenizer_config.json"
    other_eos = tok.tokenizer.id_to_token(5)  # a byte-level symbol the corpus does not hold
    config.write_text(json.dumps({"eos_token": other_eos}))  # another EOS: another stream
    other = data.prepare_data(cfg, 50257, 8)
    assert other.path != stream.path and data.open_tokens(other.path)[eos] == 5
    # Too large for gpt-tiny's 256 ids: refused, naming the directory.
    with pytest.raises(ConfigError, match=f"data.tokenizer': value '{tok_dir}' has {tok.vocab_size} "
                       "token ids, more than the model's vocabulary of 256"):
        data.dataset_for(cfg, GPT_TINY)


def test_without_an_eos_token_files_are_joined_by_a_blank_line(tmp_path):
    tok_dir = _tokenizer_dir(tmp_path / "tok", eos=None)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(SENTENCES[0])
    (corpus / "b.txt").write_text(SENTENCES[1])
    cfg = DataConfig(corpus=str(corpus), tokenizer=str(tok_dir), cache_dir=str(tmp_path / "c"))
    tok = data.text_tokenizer(cfg)
    assert tok.eos_id is None
    tokens = data.open_tokens(data.prepare_data(cfg, 50257, 8).path)
    assert tok.decode(tokens) == SENTENCES[0] + "\n\n" + SENTENCES[1]


def test_bad_tokenizer_directories_are_explained(tmp_path, monkeypatch):
    _tokenizer_dir(tmp_path / "tok")
    _raises(DataConfig(tokenizer=str(tmp_path / "nowhere")), "holds no tokenizer.json")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    _raises(DataConfig(tokenizer=str(tmp_path / "junk")), "junk/tokenizer.json is not a "
            "tokenizer the tokenizers library reads")
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "<never-seen>"}))
    _raises(DataConfig(tokenizer=str(tmp_path / "tok")), "names eos_token '<never-seen>', which "
            "is not in the vocabulary")
    config.write_text("[1, 2")
    _raises(DataConfig(tokenizer=str(tmp_path / "tok")), "tokenizer_config.json is not JSON")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the optional package not installed
    _raises(DataConfig(tokenizer=str(tmp_path / "tok")), "needs the optional 'tokenizers' package",
            "pip install 'oobleck_hpc[hf]'")


def test_tokenizers_is_optional_and_imported_by_one_module_only(tmp_path):
    """Without the package, the byte-level path works; the launcher's pre-flight imports neither
    it nor torch; and only data/hf.py imports it (inside the function that needs it)."""
    (tmp_path / "t.txt").write_text("hello " * 20)
    code = ("import sys\nsys.modules['tokenizers'] = None  # as if not installed\n"
            "from oobleck_hpc.config import DataConfig\nfrom oobleck_hpc.launch import cli\n"
            "from oobleck_hpc import data\n"
            f"data.check_data(DataConfig(corpus={str(tmp_path / 't.txt')!r}, "
            f"cache_dir={str(tmp_path / 'c')!r}), 256, 64)\n"
            "assert 'torch' not in sys.modules, 'the pre-flight imported torch'\n"
            "from oobleck_hpc.models.base import build_model\n"
            "from oobleck_hpc.config import ModelConfig\n"
            "ds = data.dataset_for(DataConfig(corpus=" + repr(str(tmp_path / "t.txt"))
            + ", cache_dir=" + repr(str(tmp_path / "c")) + ", seq_len=8), "
            "build_model(ModelConfig()))\nprint(len(ds))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["14"], out.stderr
    package = Path(data.__file__).parents[1]
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "tokenizers" or n.startswith("tokenizers.") for n in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"data/hf.py"}
