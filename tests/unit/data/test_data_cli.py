"""Tests of `goat-dist data tokenizer train / prepare / inspect` through the argparse entry point."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path

import pytest

from data_tools import encode
from data_tools import restart as restart_mod
from data_tools.cli import register
from data_tools.corpus import stdlib_documents
from data_tools.shard_format import read_manifest, split_shard_paths
from data_tools.tokenizer import load_tokenizer
from goat_dist.data import iter_documents


def goat(*argv) -> int:
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.func(args)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    texts = stdlib_documents(400_000)
    # many small documents (a few per shard) plus non-ASCII and a literal EOS string
    small = [p for t in texts for p in t.split("\n\n") if p.strip()][:400]
    return small + ["naïve café — 🐐 <|endoftext|> done"]


@pytest.fixture(scope="module")
def tokenizer(docs, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    src = d / "corpus.txt"
    src.write_text("\n\n".join(docs), encoding="utf-8")
    out = d / "tokenizer.json"
    assert goat("tokenizer", "train", "--input", src, "--vocab-size", 400, "--out", out) == 0
    assert load_tokenizer(out).get_vocab_size() == 400
    return out


def write_inputs(root: Path, docs: list[str]) -> list[Path]:
    """The same documents spread over plain text, JSONL, gzip JSONL (and Parquet when available)."""
    root.mkdir(parents=True, exist_ok=True)
    a, b, c, rest = docs[:3], docs[3:150], docs[150:300], docs[300:]
    for i, text in enumerate(a):
        (root / f"{i}.txt").write_text(text, encoding="utf-8")
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(b))
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in c)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": rest}), root / "d.parquet")
    except ImportError:
        with open(root / "d.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in rest)
    return sorted(root.iterdir())


def prepare(inputs, tokenizer, out, *extra) -> int:
    args = ["prepare", "--input", *inputs, "--tokenizer", tokenizer, "--out", out, "--no-progress"]
    return goat(*args, "--shard-size", 0.01, "--val-fraction", 0.1, *extra)


def test_prepare_inspect_round_trip(docs, tokenizer, tmp_path, capsys):
    files = write_inputs(tmp_path / "in", docs)
    out = tmp_path / "ds"
    assert prepare([tmp_path / "in"], tokenizer, out, "--workers", 2) == 0
    manifest = read_manifest(out)
    tok = load_tokenizer(out / "tokenizer.json")
    assert manifest["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert "goat-dist data prepare" in manifest["command"] and len(manifest["source"]["inputs"]) == len(files)
    assert manifest["source"]["n_docs"] == len(docs)
    assert len(manifest["splits"]["train"]) > 3 and manifest["splits"]["val"]

    # every document comes back, in input order, EOS-terminated; a literal "<|endoftext|>" stays text
    got = {}
    for split in ("train", "val"):
        for key, ids in iter_documents(split_shard_paths(out, split)):
            assert ids[-1] == manifest["eos_id"] and manifest["eos_id"] not in ids[:-1]
            got[int(key.split("-")[1])] = tok.decode(ids[:-1].tolist())
    order = [d for d in docs]  # inputs sorted: 0.txt 1.txt 2.txt b.jsonl c.jsonl.gz d.parquet
    assert [got[i] for i in range(len(docs))] == order
    n_val = sum(e["n_docs"] for e in manifest["splits"]["val"])
    assert 0.03 < n_val / len(docs) < 0.2

    capsys.readouterr()
    assert goat("inspect", out, "--decode", 2) == 0
    text = capsys.readouterr().out
    assert "[train]" in text and "[val]" in text and "0 corrupt shard" in text
    assert f"{sum(e['n_tokens'] for e in manifest['splits']['train']):,} tokens" in text
    assert docs[0][:30] in text  # decoded sample


def test_output_is_independent_of_workers(docs, tokenizer, tmp_path):
    write_inputs(tmp_path / "in", docs[:200])
    shards = {}
    for workers in (0, 1, 2):
        out = tmp_path / f"w{workers}"
        assert prepare([tmp_path / "in"], tokenizer, out, "--workers", workers) == 0
        shards[workers] = read_manifest(out)["splits"]
    assert shards[0] == shards[1] == shards[2]


def test_restart_skips_finished_shards(docs, tokenizer, tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path / "in", docs)
    clean = tmp_path / "clean"
    assert prepare([tmp_path / "in"], tokenizer, clean, "--workers", 2) == 0
    n_train = len(read_manifest(clean)["splits"]["train"])

    out = tmp_path / "crashed"
    real_add = restart_mod.PrepareProgress.add
    calls = []

    def crash_after_three(self, split, entries, end_doc):
        real_add(self, split, entries, end_doc)
        calls.append(split)
        if len(calls) == 3:
            raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(restart_mod.PrepareProgress, "add", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "in"], tokenizer, out, "--workers", 2)
    monkeypatch.setattr(restart_mod.PrepareProgress, "add", real_add)
    assert not (out / "manifest.json").exists()
    finished = sorted(out.glob("train-*.tar"))
    assert 0 < len(finished) < n_train
    mtimes = {p.name: p.stat().st_mtime_ns for p in finished}

    capsys.readouterr()
    assert prepare([tmp_path / "in"], tokenizer, out, "--workers", 1) == 0
    assert "resuming: 3 finished shard(s) kept" in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns == mtimes[p.name] for p in finished if p.name in mtimes)
    resumed, reference = read_manifest(out), read_manifest(clean)
    assert resumed["splits"] == reference["splits"]  # byte-identical shards
    assert not list(out.glob(".*"))  # no progress file, no temporaries

    capsys.readouterr()
    assert prepare([tmp_path / "in"], tokenizer, out, "--workers", 1) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert prepare([tmp_path / "in"], tokenizer, out, "--prefix", "other") == 2  # finished with other args


def test_val_docs_and_zstd(docs, tokenizer, tmp_path):
    zstandard = pytest.importorskip("zstandard")
    src = tmp_path / "docs.jsonl.zst"
    data = "".join(json.dumps({"body": t}) + "\n" for t in docs[:50]).encode()
    src.write_bytes(zstandard.ZstdCompressor().compress(data))
    out = tmp_path / "ds"
    args = ["prepare", "--input", src, "--tokenizer", tokenizer, "--out", out, "--text-field", "body"]
    assert goat(*args, "--val-docs", 7, "--workers", 0, "--no-progress") == 0
    splits = read_manifest(out)["splits"]
    assert sum(e["n_docs"] for e in splits["val"]) == 7
    assert sum(e["n_docs"] for e in splits["train"]) == 43


def test_bad_input_is_reported_with_file_and_line(tokenizer, tmp_path, capsys):
    cases = {
        "latin1.txt": (
            "first line\nsecond line caf\xe9\n".encode("latin-1"),
            "latin1.txt:2: not valid UTF-8",
        ),
        "bad.jsonl": (b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', "bad.jsonl:3: invalid JSON"),
        "nofield.jsonl": (b'{"text": "a"}\n{"body": "b"}\n', "nofield.jsonl:2: no 'text' field"),
        "notstr.jsonl": (b'{"text": 5}\n', "notstr.jsonl:1: field 'text' is int"),
        "bytes.jsonl.gz": (
            gzip.compress(b'{"text": "a"}\n{"text": "\xff"}\n'),
            "bytes.jsonl.gz:2: not valid UTF-8",
        ),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        capsys.readouterr()
        assert prepare([tmp_path / name], tokenizer, tmp_path / f"out-{name}", "--workers", 0) == 2
        assert message in capsys.readouterr().err
    assert prepare([tmp_path / "missing*.jsonl"], tokenizer, tmp_path / "o", "--workers", 0) == 2
    # bad data is a user error (exit 2) as everywhere in goat-dist, for tokenizer train too
    args = ["tokenizer", "train", "--input", tmp_path / "bad.jsonl", "--vocab-size", 300]
    assert goat(*args, "--out", tmp_path / "tok.json") == 2
    assert "bad.jsonl:3: invalid JSON" in capsys.readouterr().err


def test_inspect_names_corrupt_shards(docs, tokenizer, tmp_path, capsys):
    write_inputs(tmp_path / "in", docs[:200])
    out = tmp_path / "ds"
    assert prepare([tmp_path / "in"], tokenizer, out, "--workers", 0) == 0
    train = sorted(out.glob("train-*.tar"))
    flipped, truncated = train[1], train[2]
    data = bytearray(flipped.read_bytes())
    data[700] ^= 0x01  # inside the first sample's ids: still a valid tar
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1500])
    capsys.readouterr()
    assert goat("inspect", out) == 1
    text = capsys.readouterr().out
    assert f"CORRUPT {flipped.name}: {flipped.name} does not match its sha256" in text
    assert f"CORRUPT {truncated.name}:" in text and "doc-" in text
    assert "2 corrupt shard(s)" in text


def test_goat_dist_data_is_the_data_tools_cli(docs, tokenizer, tmp_path, capsys):
    """`goat-dist data ...` through the main entry point: the data_tools parser mounted under `data`."""
    from goat_dist.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:60]), encoding="utf-8")
    out = tmp_path / "ds"
    args = ["--input", str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--workers", "0"]
    assert main(["data", "prepare", *args, "--val-docs", "3", "--no-progress"]) == 0
    manifest = read_manifest(out)
    assert manifest["command"].startswith("goat-dist data prepare --input ")
    assert sum(e["n_docs"] for e in manifest["splits"]["val"]) == 3
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    assert "0 corrupt shard(s)" in capsys.readouterr().out
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    assert "goat-dist data inspect: error:" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_where_stderr_is_no_terminal(docs, tokenizer, tmp_path, capsys, monkeypatch):
    """In a log (stderr redirected): a line per 10 % of the input, no carriage returns; on a terminal, the
    bar as before."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:200]), encoding="utf-8")
    args = ["prepare", "--input", source, "--tokenizer", tokenizer, "--shard-size", 0.01, "--workers", 0]
    monkeypatch.setattr(encode, "CHUNK_DOCS", 16)  # 13 chunks: progress in steps
    capsys.readouterr()
    assert goat(*args, "--out", tmp_path / "logged") == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[data] prepare: ")]
    assert "\r" not in err and 3 <= len(lines) <= 10, err
    assert lines[-1].startswith("[data] prepare: 100% (") and lines[-1].endswith(" tokens"), lines[-1]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines]
    assert percents == sorted(set(percents)) and all(p % 10 == 0 for p in percents)

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert goat(*args, "--out", tmp_path / "shown") == 0
    assert "\r" in terminal.getvalue() and "[data] prepare: " not in terminal.getvalue()
