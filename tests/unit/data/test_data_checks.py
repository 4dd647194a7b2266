"""The data check training starts with (``data.batches.check_sources``, and ``data_sources`` in the trainer):
every local data set there, of the model's vocabulary, with a val split when evaluation is on, one
tokenizer for all sources, and every shard it will read on disk at its manifest's size. Each refusal is one
message naming the setting or file and the fix, of a kind the command line exits 2 for. Also ``data
prepare --val-docs 0``, which makes the data set without a val split. In-process; tiny data sets."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from data_tools.cli import register
from data_tools.shard_format import ShardError, read_manifest, write_manifest
from data_tools.writer import ShardWriter
from goat_dist.config import ConfigError, load_config
from goat_dist.data import batches
from goat_dist.trainer.entry import exit_code_for, user_error_message

SHA_A, SHA_B = "a" * 64, "b" * 64


def dataset(root, sha: str = SHA_A, vocab: int = 300, val: bool = True, shard_mb: float = 0.003):
    """Documents of 100 random ids in shards of a few kB (several per split), with their manifest."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, docs in (("train", 24), ("val", 6 if val else 0)):
        with ShardWriter(root, split, shard_mb, vocab_size=vocab) as w:
            for d in range(docs):
                w.write(f"doc-{d:05d}", rng.integers(1, vocab, 100))
        splits[split] = w.shards
    write_manifest(root, {"vocab_size": vocab, "dtype": "uint16", "tokenizer_sha256": sha, "splits": splits})
    return root


def config(*overrides: str, eval_interval: int = 0, on_error: str = "raise"):
    return load_config(
        None,
        [
            "model.vocab_size=300",
            f"train.eval_interval={eval_interval}",
            f"data.on_error={on_error}",
            *overrides,
        ],
    )


@pytest.fixture(autouse=True)
def first_process_of_its_node(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    batches._CHECKED.clear()


def test_a_deleted_shard_is_refused_at_the_start_naming_the_file(tmp_path):
    data = dataset(tmp_path / "d")
    shards = read_manifest(data)["splits"]["train"]
    assert len(shards) >= 3, shards
    (data / shards[1]["name"]).unlink()
    with pytest.raises(ShardError) as info:
        batches.check_sources(config(f"data.source={data}"))
    message = user_error_message(info.value)
    assert f"data.source={data}" in message and f"shard {shards[1]['name']} is missing" in message
    assert f"the manifest lists {shards[1]['bytes']} bytes" in message
    assert "data.on_error=skip" in message and "goat-dist data prepare" in message
    assert message.count("fix") <= 1 and "\n" not in message  # one line: no second, generic fix added
    assert exit_code_for(info.value) == 2


def test_a_truncated_shard_and_a_missing_index_are_named(tmp_path):
    data = dataset(tmp_path / "d")
    first, second = read_manifest(data)["splits"]["train"][:2]
    os.truncate(data / first["name"], first["bytes"] // 2)
    (data / second["index"]["name"]).unlink()
    with pytest.raises(ShardError) as info:
        batches.check_sources(config(f"data.source={data}"))
    message = str(info.value)
    assert f"shard {first['name']} is {first['bytes'] // 2} bytes on disk, the manifest says" in message
    assert "truncated" in message and "2 file(s) of the data set differ" in message
    assert f"index {second['index']['name']} of shard {second['name']} is missing" in message


def test_a_failed_check_is_made_again_and_a_passed_one_once(tmp_path, monkeypatch):
    data = dataset(tmp_path / "d")
    shard = data / read_manifest(data)["splits"]["train"][0]["name"]
    kept = shard.read_bytes()
    shard.unlink()
    cfg = config(f"data.source={data}")
    for _ in range(2):  # a refusal is not remembered: the second call refuses too
        with pytest.raises(ShardError):
            batches.check_sources(cfg)
    shard.write_bytes(kept)
    batches.check_sources(cfg)
    calls = []
    monkeypatch.setattr(batches, "shard_file_problems", lambda *a: calls.append(a) or [])
    batches.check_sources(cfg)  # data_sources in the trainer after the start: no second pass of stats
    assert calls == []


def test_only_the_validation_shards_evaluation_reads_are_checked(tmp_path):
    data = dataset(tmp_path / "d")
    (data / read_manifest(data)["splits"]["val"][0]["name"]).unlink()
    batches.check_sources(config(f"data.source={data}"))  # no evaluation: the val split is never read
    with pytest.raises(ShardError, match="shard val-000000.tar is missing"):
        batches.check_sources(config(f"data.source={data}", eval_interval=10))


def test_on_error_skip_warns_once_and_trains(tmp_path):
    data = dataset(tmp_path / "d")
    (data / read_manifest(data)["splits"]["train"][0]["name"]).unlink()
    said = []
    cfg = config(f"data.source={data}", on_error="skip")
    batches.check_sources(cfg, log=said.append)
    batches.check_sources(cfg, log=said.append)
    assert len(said) == 1 and said[0].startswith("warning: data.source=")
    assert "train-000000.tar is missing" in said[0] and "data.on_error=skip masks their samples" in said[0]


def test_only_the_first_process_of_a_node_stats_the_shards(tmp_path, monkeypatch):
    """The per-node rule: LOCAL_RANK > 0 makes no stat; the manifest checks are every process's."""
    data = dataset(tmp_path / "d")
    (data / read_manifest(data)["splits"]["train"][0]["name"]).unlink()
    monkeypatch.setenv("LOCAL_RANK", "1")
    batches.check_sources(config(f"data.source={data}"))
    with pytest.raises(ConfigError, match="larger than model.vocab_size=200"):
        batches.check_sources(config(f"data.source={data}", "model.vocab_size=200"))


def test_no_val_split_with_evaluation_on_is_refused_by_name(tmp_path):
    from goat_dist.data.sources import resolve_sources

    data = dataset(tmp_path / "d", val=False)
    batches.check_sources(config(f"data.source={data}"))  # train.eval_interval=0: fine
    with pytest.raises(ConfigError) as info:
        batches.check_sources(config(f"data.source={data}", eval_interval=25))
    message = user_error_message(info.value)
    assert f"data.source={data}: the data set has no validation shards" in message
    assert "0 val shard(s)" in message and "train.eval_interval=25" in message
    assert "set train.eval_interval=0" in message and "--val-docs N" in message
    assert exit_code_for(info.value) == 2
    with pytest.raises(ConfigError, match="has no 'val' shards .* train.eval_interval=0"):
        resolve_sources([str(data)], "val")  # the loader's own check, for a caller without check_sources


def test_sources_with_different_tokenizers_are_refused_by_name(tmp_path):
    from goat_dist.data.sources import resolve_sources

    a, b = dataset(tmp_path / "a", SHA_A), dataset(tmp_path / "b", SHA_B)
    cfg = config()
    cfg.data.sources = [{"path": str(a), "weight": 1.0}, {"path": str(b), "weight": 2.0}]
    with pytest.raises(ConfigError) as info:
        batches.check_sources(cfg)
    message = user_error_message(info.value)
    assert "different tokenizers" in message and f"data.sources[0].path={a}: {SHA_A}" in message
    assert f"data.sources[1].path={b}: {SHA_B}" in message and "--tokenizer FILE" in message
    assert exit_code_for(info.value) == 2
    with pytest.raises(ConfigError, match="different tokenizers"):
        resolve_sources([str(a), str(b)], "train")
    cfg.data.sources = [{"path": str(a)}, {"path": str(dataset(tmp_path / "c", SHA_A))}]
    batches.check_sources(cfg)


def test_the_trainers_data_sources_make_the_same_checks(tmp_path):
    """``data_sources`` (the trainer, after the model is built) refuses what ``check_sources`` refuses, for
    a run started without the start-of-training check (a Trainer made in Python)."""
    import torch

    from goat_dist.distributed import Layout

    layout = Layout(1, 0, 0, 1, 1, 0, 0, torch.device("cpu"))
    data = dataset(tmp_path / "d", val=False)
    with pytest.raises(ConfigError, match="no validation shards"):
        batches.data_sources(config(f"data.source={data}", eval_interval=5), layout)
    (data / "train-000000.tar").unlink()
    with pytest.raises(ShardError, match="train-000000.tar is missing"):
        batches.data_sources(config(f"data.source={data}"), layout)


def test_doctor_makes_the_same_check(tmp_path):
    """``goat-dist doctor``'s data check is the shared one: it sees a missing index too."""
    from goat_dist.doctor import shard_size_problems

    data = dataset(tmp_path / "d")
    entry = read_manifest(data)["splits"]["val"][0]
    (data / entry["index"]["name"]).unlink()
    assert shard_size_problems(data, read_manifest(data)) == [
        f"index {entry['index']['name']} of shard {entry['name']} is missing (the manifest lists "
        f"{entry['index']['bytes']} bytes)"
    ]


def data_cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.func(args)


def test_prepare_with_zero_val_docs_makes_a_train_only_data_set(tmp_path, capsys):
    """``--val-docs 0`` used to fail with an IndexError; it makes a data set without val shards, and says
    how to train on it."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"text": "def f{i}(x):\\n    return x * {i}\\n"}}\n' for i in range(40)))
    tok = tmp_path / "tokenizer.json"
    assert data_cli("tokenizer", "train", "--input", src, "--vocab-size", 280, "--out", tok) == 0
    out = tmp_path / "ds"
    args = ["prepare", "--input", src, "--tokenizer", tok, "--out", out, "--workers", 0, "--no-progress"]
    assert data_cli(*args, "--val-docs", 0) == 0
    splits = read_manifest(out)["splits"]
    assert splits["val"] == [] and sum(e["n_docs"] for e in splits["train"]) == 40
    assert "no val split, as asked: train on it with train.eval_interval=0" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no validation shards"):
        batches.check_sources(config(f"data.source={out}", eval_interval=10))
