"""Tests of the data layer: corpus, tokenizer, shard format (written by data_tools, read by goat_dist.data)
and the built-in data set."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from data_tools import builtin as builtin_mod
from data_tools.builtin import prepare_builtin_dataset
from data_tools.corpus import stdlib_documents
from data_tools.inspection import verify_shards
from data_tools.shard_format import (
    FORMAT,
    ShardError,
    dtype_name,
    read_manifest,
    split_shard_paths,
    write_manifest,
)
from data_tools.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, train_bpe
from data_tools.writer import ShardWriter
from goat_dist.atomic import sha256_file
from goat_dist.data import build_train_loader, iter_documents

SMALL_BYTES = 300_000


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return stdlib_documents(SMALL_BYTES)


# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_capped(texts):
    assert texts == stdlib_documents(SMALL_BYTES)
    assert len(texts) > 3
    assert sum(len(t.encode("utf-8")) for t in texts) <= SMALL_BYTES
    joined = "\n".join(texts)
    assert "def " in joined and " the " in joined  # code and English prose
    with pytest.raises(ValueError):
        stdlib_documents(0)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_eos(texts, tmp_path):
    tok = train_bpe(texts, 512, tmp_path / "tokenizer.json")
    assert tok.get_vocab_size() == 512
    eos = eos_id(tok)
    assert tok.token_to_id(EOS_TOKEN) == eos
    sample = 'def greet(name):\n    """Return a greeting, naïvely — 🐐."""\n    return f"hi {name}"\n'
    ids = tok.encode(sample).ids
    assert eos not in ids
    assert tok.decode(ids) == sample
    assert len(ids) < len(sample.encode("utf-8"))  # merges actually compress

    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.encode(sample).ids == ids
    assert eos_id(loaded) == eos
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temp file


def test_tokenizer_training_is_deterministic(texts, tmp_path):
    a = train_bpe(texts, 512, tmp_path / "a.json")
    b = train_bpe(texts, 512, tmp_path / "b.json")
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_tokenizer_errors(texts, tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(bad)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, 100, tmp_path / "x.json")


# ---------------------------------------------------------------- shards


def _random_docs(n: int, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"doc-{i:07d}": rng.integers(0, vocab_size, size=int(rng.integers(1, 2000))) for i in range(n)}


def _write(out_dir: Path, docs: dict, vocab_size: int, prefix="train", shard_size_mb=0.02) -> list[dict]:
    with ShardWriter(out_dir, prefix, shard_size_mb, vocab_size=vocab_size) as w:
        for key, ids in docs.items():
            w.write(key, ids)
    return w.shards


@pytest.mark.parametrize("vocab_size", [1000, 65535, 70_000])
def test_shard_round_trip(tmp_path, vocab_size):
    docs = _random_docs(40, vocab_size)
    docs["doc-9999999"] = np.array([vocab_size - 1, 0])  # extreme ids survive
    shards = _write(tmp_path, docs, vocab_size)
    assert len(shards) > 1
    assert [e["name"] for e in shards] == [f"train-{i:06d}.tar" for i in range(len(shards))]
    assert sum(e["n_docs"] for e in shards) == len(docs)
    assert sum(e["n_tokens"] for e in shards) == sum(len(v) for v in docs.values())
    for e in shards:
        path = tmp_path / e["name"]
        assert sha256_file(path) == e["sha256"]
        assert path.stat().st_size == e["bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    got = list(iter_documents([tmp_path / e["name"] for e in shards]))
    assert [k for k, _ in got] == list(docs)
    expected_dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    for (key, ids), ref in zip(got, docs.values(), strict=True):
        assert ids.dtype == expected_dtype, key
        np.testing.assert_array_equal(ids, ref)

    manifest = {
        "vocab_size": vocab_size,
        "dtype": dtype_name(vocab_size),
        "tokenizer_sha256": "0" * 64,
        "splits": {"train": shards, "val": []},
    }
    write_manifest(tmp_path, manifest)
    read = read_manifest(tmp_path)
    assert read["format"] == FORMAT
    assert read["splits"]["train"] == shards
    verify_shards(tmp_path)


def test_shards_are_reproducible(tmp_path):
    docs = _random_docs(10, 1000)
    a = _write(tmp_path / "a", docs, 1000)
    b = _write(tmp_path / "b", docs, 1000)
    assert a == b


def test_shard_writer_rejects_bad_input(tmp_path):
    with ShardWriter(tmp_path, vocab_size=100) as w:
        w.write("doc-1", [1, 2, 3])
        for key in ["", "a.b", "a/b", "__meta__", "doc-1"]:
            with pytest.raises(ValueError):
                w.write(key, [1])
        with pytest.raises(ValueError, match="out of range"):
            w.write("doc-2", [5, 100])
        with pytest.raises(ValueError):
            w.write("doc-3", [])
        with pytest.raises(ValueError):
            w.write("doc-4", [1.5])


def test_shard_writer_abort_leaves_no_temp_file(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, vocab_size=100) as w:
            w.write("doc-1", [1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(ValueError, match="manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(ValueError, match="something-else"):
        read_manifest(tmp_path)
    with pytest.raises(ValueError):
        write_manifest(tmp_path, {"format": "other", "vocab_size": 10, "splits": {}})


def test_truncated_shard_names_shard_and_sample(tmp_path):
    docs = _random_docs(5, 1000)
    shards = _write(tmp_path, docs, 1000, shard_size_mb=64)
    path = tmp_path / shards[0]["name"]
    with open(path, "r+b") as f:
        f.truncate(512 + 100)  # inside the data of the first member
    with pytest.raises(ShardError) as info:
        list(iter_documents([path]))
    assert shards[0]["name"] in str(info.value)
    assert "doc-0000000" in str(info.value)


def test_verify_shards_catches_truncation_at_member_boundary(tmp_path):
    docs = {f"doc-{i}": np.arange(256) for i in range(4)}  # each member: 512 header + 512 data
    shards = _write(tmp_path, docs, 1000, shard_size_mb=64)
    write_manifest(tmp_path, {"vocab_size": 1000, "dtype": "uint16", "splits": {"train": shards}})
    path = tmp_path / shards[0]["name"]
    with open(path, "r+b") as f:
        f.truncate(2 * 1024)  # exactly two whole samples: tar itself can't tell
    assert len(list(iter_documents([path]))) == 2
    with pytest.raises(ShardError, match=shards[0]["name"]):
        verify_shards(tmp_path)


# ---------------------------------------------------------------- built-in data set


def test_prepare_builtin_dataset_is_idempotent(tmp_path, texts):
    logs: list[str] = []
    d = prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=SMALL_BYTES, log=logs.append)
    assert d == tmp_path / "builtin-stdlib-v512-300000b"  # a non-default size has a directory of its own
    assert logs and any("tokens" in line for line in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name]  # no temp dirs left
    manifest = read_manifest(d)
    assert manifest["vocab_size"] == 512 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer_sha256"] == sha256_file(d / "tokenizer.json")
    assert manifest["splits"]["train"] and manifest["splits"]["val"]
    verify_shards(d)

    tok = load_tokenizer(d / "tokenizer.json")
    eos = eos_id(tok)
    train = split_shard_paths(d, "train")
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in train)
    docs = list(iter_documents(train))
    assert len(docs) == sum(e["n_docs"] for e in manifest["splits"]["train"])
    assert all(ids[-1] == eos and eos not in ids[:-1] for _, ids in docs)
    for key, ids in docs[:20]:  # the whole pipeline is lossless: shards decode to the corpus text
        assert tok.decode(ids[:-1].tolist()) == texts[int(key.split("-")[1])]

    t0 = time.perf_counter()
    again = prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=SMALL_BYTES, log=logs.append)
    assert time.perf_counter() - t0 < 1.0
    assert again == d and read_manifest(again) == manifest

    assert builtin_mod.builtin_dataset_dir(tmp_path, 512, SMALL_BYTES + 1) != d  # another size, another dir

    batch = next(
        iter(build_train_loader([str(d)], seq_len=64, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0))
    )
    assert int(batch["tokens"].max()) < 512


def test_prepare_builtin_dataset_crash_leaves_nothing(tmp_path, monkeypatch):
    def crash(out, *args, **kwargs):
        (out / "train-000000.tar").write_bytes(b"partial")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(builtin_mod, "_build", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=SMALL_BYTES, log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_builtin_sizes_live_side_by_side(tmp_path):
    """A smaller build (what the tests use) never blocks the default build in the same cache directory:
    each size has its own directory, and a directory's own settings are still checked on reuse."""
    from data_tools.builtin import builtin_dataset_dir

    assert builtin_dataset_dir(tmp_path, 4096).name == "builtin-stdlib-v4096"  # the default's name is kept
    small = prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=150_000, log=lambda *a: None)
    other = prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=SMALL_BYTES, log=lambda *a: None)
    assert small != other and read_manifest(small)["source"]["max_bytes"] == 150_000
    assert read_manifest(other)["source"]["max_bytes"] == SMALL_BYTES
    assert prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=150_000, log=lambda *a: None) == small
    (small / "manifest.json").write_text((other / "manifest.json").read_text())  # settings changed under it
    with pytest.raises(ValueError, match="was built with"):
        prepare_builtin_dataset(tmp_path, vocab_size=512, max_bytes=150_000, log=lambda *a: None)
