"""`data prepare --input` of Hugging Face `datasets` on disk (save_to_disk directories, a datasets cache's
Arrow files) and of a directory of Parquet files laid out like the hub cache: the shards decode to the
rows, in order; a wrong --text-field is one message and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from data_tools.cli import register
from data_tools.shard_format import read_manifest, split_shard_paths
from data_tools.tokenizer import load_tokenizer, train_bpe
from goat_dist.data import iter_documents

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [f"row {i}: naïve café 🐐 " + "word " * (i % 7) for i in range(40)]


def goat(*argv) -> int:
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.func(args)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(ROWS * 3, 300, out)
    return out


def prepared(tokenizer, out: Path, *inputs) -> list[str]:
    """The documents of a `prepare` of `inputs` (all in train), decoded, in order, each EOS-ended."""
    args = ["prepare", "--input", *inputs, "--tokenizer", tokenizer, "--out", out, "--no-progress"]
    assert goat(*args, "--workers", 0, "--val-fraction", 0) == 0
    manifest, tok = read_manifest(out), load_tokenizer(out / "tokenizer.json")
    assert not manifest["splits"]["val"]
    docs = [ids for _, ids in iter_documents(split_shard_paths(out, "train"))]
    assert all(ids[-1] == manifest["eos_id"] for ids in docs)
    return [tok.decode(ids[:-1].tolist()) for ids in docs]


def test_save_to_disk_directories(tokenizer, tmp_path, monkeypatch):
    """A Dataset saved in three shards is read in its row order; a DatasetDict found inside a directory
    gives its train split only, sorted among the directory's other files by path (a loose .arrow file
    there is skipped); another split is read by naming its directory. `datasets` itself is not needed."""
    rows = datasets.Dataset.from_dict({"text": ROWS, "n": list(range(len(ROWS)))})
    rows.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    splits = datasets.DatasetDict({"train": rows.select(range(10, 40)), "test": rows.select(range(10))})
    monkeypatch.setitem(sys.modules, "datasets", None)  # read without it: `import datasets` now fails
    assert prepared(tokenizer, tmp_path / "out-ds", tmp_path / "ds") == ROWS

    root = tmp_path / "corpus"
    splits.save_to_disk(str(root / "dd"))
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ROWS[:10]))
    (root / "cache-0123.arrow").write_bytes((root / "dd" / "test" / "data-00000-of-00001.arrow").read_bytes())
    assert prepared(tokenizer, tmp_path / "out-dd", root) == ROWS  # a.jsonl, then dd's train split
    assert prepared(tokenizer, tmp_path / "out-test", root / "dd" / "test") == ROWS[:10]  # a split by name


def test_parquet_directory_and_cache_arrow_files(tokenizer, tmp_path):
    """Parquet files under a directory (symlinks into blobs/, as the hub cache keeps them, with long row
    groups read a batch at a time) and the Arrow file `load_dataset` wrote into a datasets cache."""
    snapshot, blobs = tmp_path / "snapshots" / "abc123" / "data", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, part in enumerate((ROWS[:25], ROWS[25:])):
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}), blobs / f"b{i}")
        os.symlink(blobs / f"b{i}", snapshot / f"train-0000{i}-of-00002.parquet")
    assert prepared(tokenizer, tmp_path / "out-pq", tmp_path / "snapshots") == ROWS

    cache = tmp_path / "hf-datasets"
    datasets.load_dataset("parquet", data_files={"train": str(blobs / "b0")}, cache_dir=str(cache))
    (arrow,) = cache.glob("parquet/*/*/*/parquet-train*.arrow")  # <cache>/<name>/<config>/<version>/<hash>/
    glob = str(arrow.parent / "parquet-train*.arrow")
    assert prepared(tokenizer, tmp_path / "out-arrow", glob) == ROWS[:25]


def test_parquet_and_arrow_stream_a_batch_of_rows_at_a_time(tmp_path):
    """One row group of Parquet and one record batch of Arrow, each ~10 MB of text: after the first
    document, the Python objects made hold under a fifth of it (a whole-batch read holds it all), the
    memory-mapped Arrow file takes nothing from pyarrow's pool, and every row comes back."""
    import random
    import tracemalloc

    from data_tools.inputs import iter_file

    rnd = random.Random(0)
    words = ["".join(rnd.choices("abcdefghij", k=rnd.randint(2, 9))) for _ in range(3000)]
    texts = [" ".join(rnd.choices(words, k=170)) for _ in range(10_000)]
    size = sum(map(len, texts))
    table = pa.table({"text": texts})
    pq.write_table(table, tmp_path / "one-group.parquet", row_group_size=len(texts))
    with pa.ipc.new_stream(tmp_path / "one-batch.arrow", table.schema) as writer:
        writer.write_batch(table.to_batches(max_chunksize=len(texts))[0])
    del table
    for name in ("one-group.parquet", "one-batch.arrow"):
        tracemalloc.start()
        pool = pa.total_allocated_bytes()
        docs = iter_file(tmp_path / name)
        first, _ = next(docs)
        made, pool = tracemalloc.get_traced_memory()[0], pa.total_allocated_bytes() - pool
        tracemalloc.stop()
        assert made < size / 5, (name, made, size)
        assert name.endswith(".parquet") or pool < size / 100, (name, pool)
        assert [first, *(text for text, _ in docs)] == texts


def test_a_wrong_text_field_is_named_with_the_columns_there(tokenizer, tmp_path, capsys):
    """--text-field naming no column, or a non-text one, of a save_to_disk data set or a Parquet file: one
    message with the text columns that exist, exit 2, nothing written. A DatasetDict without a train
    split: its splits are named."""
    datasets.Dataset.from_dict({"body": ROWS, "n": list(range(len(ROWS)))}).save_to_disk(str(tmp_path / "ds"))
    pq.write_table(pa.table({"body": ROWS}), tmp_path / "x.parquet")
    test_only = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ROWS})})
    test_only.save_to_disk(str(tmp_path / "dd"))
    cases = [
        (tmp_path / "ds", "text", "--text-field 'text': ", "has no such column (columns: ['body', 'n'])"),
        (tmp_path / "ds", "n", "--text-field 'n': ", "it is a int64 column, not text"),
        (tmp_path / "x.parquet", "text", "--text-field 'text': ", "has no such column (columns: ['body'])"),
        (tmp_path / "dd", "text", f"--input {tmp_path / 'dd'}: a DatasetDict without a 'train' split", ""),
    ]
    for i, (source, field, start, middle) in enumerate(cases):
        capsys.readouterr()
        out = tmp_path / f"o{i}"
        args = ["--input", source, "--tokenizer", tokenizer, "--out", out, "--text-field", field]
        assert goat("prepare", *args, "--no-progress") == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"goat-dist data prepare: error: {start}"), err
        assert middle in err and not out.exists()
        dd = "DatasetDict" in start
        assert (f"e.g. --input {tmp_path / 'dd' / 'test'}" if dd else "with one of its text columns") in err
