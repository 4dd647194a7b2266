"""`data prepare --out` and `data tokenizer train --out` never replace or delete a file the tool did not
write: a directory prepare did not make is refused, a finished data set built otherwise needs --overwrite
(which replaces only what its manifest lists), an interrupted prepare of other arguments needs --restart
(which deletes only what its progress record lists), and an existing tokenizer file needs --force. Each
refusal names the directory or file and changes nothing."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from data_tools import restart as restart_mod
from data_tools.cli import register
from data_tools.restart import PROGRESS_NAME
from data_tools.shard_format import read_manifest


def goat(*argv) -> int:
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.func(args)


DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # {'goat ' * (i % 7)}\n" * 4 for i in range(160)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert goat("tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--out", out) == 0
    return out


def prepare(corpus, tokenizer, out, *extra) -> int:
    args = ["prepare", "--input", corpus, "--tokenizer", tokenizer, "--out", out, "--no-progress"]
    return goat(*args, "--workers", 0, "--shard-size", 0.01, "--val-docs", 4, *extra)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def interrupted(corpus, tokenizer, out, monkeypatch, *extra, after: int = 3, recorded: bool = True):
    """A prepare stopped after `after` shards; with `recorded=False` the last one is on disk but not yet
    in the progress record (the crash window between a shard's rename and its record)."""
    real_add = restart_mod.PrepareProgress.add
    calls = []

    def stop(self, split, entries, end_doc):
        if entries:
            calls.append(split)
            if len(calls) == after and not recorded:
                raise KeyboardInterrupt("preempted")
        real_add(self, split, entries, end_doc)
        if len(calls) == after:
            raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(restart_mod.PrepareProgress, "add", stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, tokenizer, out, *extra)
    monkeypatch.setattr(restart_mod.PrepareProgress, "add", real_add)
    assert not (out / "manifest.json").exists()


# ---------------------------------------------------------------- a directory prepare did not write


def test_prepare_refuses_a_directory_it_did_not_write(corpus, tokenizer, tmp_path, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "tokenizer.json").write_text('{"mine": true}')
    (user / "train-000000.tar").write_bytes(b"my own tar")
    (user / ".train-000001.tar.abcd1234.tmp").write_bytes(b"looks like a temporary")
    before = snapshot(user)
    capsys.readouterr()
    assert prepare(corpus, tokenizer, user) == 2
    err = capsys.readouterr().err
    assert f"--out {user} is not empty and is no output of prepare" in err
    assert "would overwrite tokenizer.json, train-000000.tar" in err and "nothing was changed" in err
    assert snapshot(user) == before

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert prepare(corpus, tokenizer, other) == 2
    err = capsys.readouterr().err
    assert f"--out {other} is not empty" in err and "it holds notes.txt" in err
    assert snapshot(other) == {"notes.txt": b"x"}

    # `tokenizer train --out ds/tokenizer.json`, then `prepare --tokenizer ds/tokenizer.json --out ds`: fine
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    assert prepare(corpus, ds / "tokenizer.json", ds) == 0
    assert read_manifest(ds)["source"]["n_docs"] == len(DOCS)


# ---------------------------------------------------------------- a finished data set: --overwrite


def test_a_finished_data_set_is_replaced_only_with_overwrite(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "ds"
    assert prepare(corpus, tokenizer, out) == 0
    old = read_manifest(out)
    assert len(old["splits"]["train"]) > 4
    (out / "notes.txt").write_text("the user's")
    (out / "b-000000.tar").write_bytes(b"the user's own tar")
    before = snapshot(out)

    capsys.readouterr()
    assert prepare(corpus, tokenizer, out, "--shard-size", 0.03) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a data set built from other inputs or arguments" in err
    assert "--shard-size: 0.01 then, 0.03 now" in err and "--overwrite" in err
    assert snapshot(out) == before

    # another prefix would overwrite a file the data set does not list: refused even with --overwrite
    assert prepare(corpus, tokenizer, out, "--prefix", "b", "--overwrite") == 2
    assert f"prepare would overwrite b-000000.tar in {out}" in capsys.readouterr().err
    assert snapshot(out) == before

    assert prepare(corpus, tokenizer, out, "--shard-size", 0.03, "--overwrite") == 0
    new = read_manifest(out)
    assert len(new["splits"]["train"]) < len(old["splits"]["train"])
    listed = {n for v in new["splits"].values() for e in v for n in (e["name"], e["index"]["name"])}
    assert set(os.listdir(out)) == listed | {"manifest.json", "tokenizer.json", "notes.txt", "b-000000.tar"}
    assert (out / "notes.txt").read_text() == "the user's"
    assert (out / "b-000000.tar").read_bytes() == b"the user's own tar"
    capsys.readouterr()
    assert prepare(corpus, tokenizer, out, "--shard-size", 0.03) == 0  # same arguments: nothing to do
    assert "nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------- an interrupted prepare: --restart


def test_an_interrupted_prepare_of_other_arguments_is_kept_until_restart(
    corpus, tokenizer, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "ds"
    interrupted(corpus, tokenizer, out, monkeypatch, "--prefix", "wiki")
    wiki = sorted(out.glob("wiki-*.tar"))
    assert len(wiki) == 3
    (out / "notes.txt").write_text("the user's")
    before = snapshot(out)

    capsys.readouterr()
    assert prepare(corpus, tokenizer, out, "--prefix", "code") == 2
    err = capsys.readouterr().err
    assert f"{out / PROGRESS_NAME} records an interrupted prepare into {out}" in err
    assert "--prefix: 'wiki' then, 'code' now" in err and "--restart" in err and "nothing was changed" in err
    assert snapshot(out) == before  # the wiki shards are still there

    # a touched input: refused too (its content could have changed), with how to restore it if not
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert prepare(corpus, tokenizer, out, "--prefix", "wiki") == 2
    err = capsys.readouterr().err
    assert "1 file(s) of the same size modified since" in err and "touch -d @" in err
    assert snapshot(out) == before
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    assert prepare(corpus, tokenizer, out, "--prefix", "code", "--restart") == 0
    assert "--restart: deleted" in capsys.readouterr().out
    assert not list(out.glob("wiki-*")) and (out / "notes.txt").read_text() == "the user's"
    assert read_manifest(out)["splits"]["train"][0]["name"] == "code-000000.tar"
    assert not (out / PROGRESS_NAME).exists()


def test_a_prepare_that_failed_before_any_shard_is_retried_without_restart(tokenizer, tmp_path, capsys):
    """A bad input line stops prepare before it finished a shard; once the input is fixed (another size:
    other arguments), the same command runs: there is nothing of the failed run to keep."""
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) + "\n" for d in DOCS]
    source.write_text("".join(lines[:2]) + '{"text": oops}\n' + "".join(lines[3:]), encoding="utf-8")
    out = tmp_path / "ds"
    capsys.readouterr()
    assert prepare(source, tokenizer, out) == 2
    assert "docs.jsonl:3: invalid JSON" in capsys.readouterr().err
    assert (out / PROGRESS_NAME).exists() and not list(out.glob("train-*"))

    source.write_text("".join(lines), encoding="utf-8")
    assert prepare(source, tokenizer, out) == 0
    assert "finished no shard: starting over" in capsys.readouterr().out
    assert read_manifest(out)["source"]["n_docs"] == len(DOCS) and not (out / PROGRESS_NAME).exists()


def test_a_failed_prepare_that_committed_a_shard_still_needs_restart(
    corpus, tokenizer, tmp_path, monkeypatch, capsys
):
    """A shard on disk the record only claims (renamed just before the crash) is a finished shard too."""
    out = tmp_path / "ds"
    interrupted(corpus, tokenizer, out, monkeypatch, "--prefix", "wiki", after=1, recorded=False)
    record = json.loads((out / PROGRESS_NAME).read_text())
    assert not any(record["splits"].values()) and (out / "wiki-000000.tar").exists()
    capsys.readouterr()
    assert prepare(corpus, tokenizer, out, "--prefix", "code") == 2
    assert "--restart" in capsys.readouterr().err and (out / "wiki-000000.tar").exists()


def test_resume_keeps_working_and_owns_a_shard_committed_before_its_record(
    corpus, tokenizer, tmp_path, monkeypatch, capsys
):
    clean = tmp_path / "clean"
    assert prepare(corpus, tokenizer, clean) == 0
    out = tmp_path / "ds"
    interrupted(corpus, tokenizer, out, monkeypatch, recorded=False)
    record = json.loads((out / PROGRESS_NAME).read_text())
    on_disk = sorted(p.name for p in out.glob("train-*.tar"))
    listed = [e["name"] for e in record["splits"]["train"]]
    assert len(on_disk) == len(listed) + 1 and on_disk[-1] in record["claimed"]

    capsys.readouterr()
    assert prepare(corpus, tokenizer, out) == 0
    assert f"resuming: {len(listed)} finished shard(s) kept" in capsys.readouterr().out
    assert read_manifest(out)["splits"] == read_manifest(clean)["splits"]
    assert not list(out.glob(".*"))

    # a progress record of an earlier version (no "claimed", no "settings") still resumes
    old = tmp_path / "old"
    interrupted(corpus, tokenizer, old, monkeypatch)
    record = json.loads((old / PROGRESS_NAME).read_text())
    (old / PROGRESS_NAME).write_text(
        json.dumps({"fingerprint": record["fingerprint"], "splits": record["splits"]})
    )
    assert prepare(corpus, tokenizer, old) == 0
    assert read_manifest(old)["splits"] == read_manifest(clean)["splits"]


def test_a_progress_record_never_names_a_file_outside_its_directory(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "ds"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    record = {"fingerprint": "other", "splits": {"train": [{"name": "../victim.txt"}]}}
    (out / PROGRESS_NAME).write_text(json.dumps(record))
    capsys.readouterr()
    assert prepare(corpus, tokenizer, out, "--restart") == 2
    assert "'../victim.txt', no file name in its directory" in capsys.readouterr().err
    assert victim.read_text() == "keep"


# ---------------------------------------------------------------- tokenizer train --out


def test_tokenizer_train_refuses_an_existing_file_without_force(corpus, tokenizer, tmp_path, capsys):
    ds = tmp_path / "ds"
    assert prepare(corpus, tokenizer, ds) == 0
    before = (ds / "tokenizer.json").read_bytes()
    train = ["tokenizer", "train", "--input", corpus, "--vocab-size", 280]
    capsys.readouterr()
    assert goat(*train, "--out", ds / "tokenizer.json") == 2
    err = capsys.readouterr().err
    assert f"{ds / 'tokenizer.json'} already exists (not replaced)" in err
    assert f"the tokenizer of the data set in {ds}" in err and "--force" in err
    assert (ds / "tokenizer.json").read_bytes() == before
    assert not [p for p in ds.iterdir() if p.name.endswith(".tmp")]

    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    assert goat(*train, "--out", mine, "--force") == 0
    assert json.loads(mine.read_text())["model"]["type"] == "BPE"
