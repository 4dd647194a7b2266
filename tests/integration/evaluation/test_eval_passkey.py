"""The synthetic passkey task: sequences, training examples, and the loader's rank/resume contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from goat_dist.data import synthetic as S
from goat_dist.data.loader import IGNORE_INDEX
from goat_dist.evaluation.passkey import cell_samples


@pytest.mark.parametrize("length,depth", [(13, 0.0), (40, 0.0), (40, 0.5), (40, 1.0), (1000, 0.3)])
def test_sequence_layout(length, depth):
    seq = S.passkey_sequence(length, depth, np.random.default_rng(1))
    assert seq.shape == (length + 1,) and seq.min() >= 0 and seq.max() < S.VOCAB
    k = S.key_position(seq)
    digits = seq[k + 1 : k + 1 + S.DIGITS]
    assert seq[k + S.DIGITS + 1] == S.KEY_END and seq[-S.DIGITS - 1] == S.QUERY
    assert (seq[-S.DIGITS :] == digits).all() and ((digits >= S.DIGIT0) & (digits < S.DIGIT0 + 10)).all()
    filler = length + 1 - S.MIN_LENGTH
    assert k == round(depth * filler)
    # the model reads `length` tokens and must predict the answer at answer_positions
    answer = S.answer_positions(length)
    assert (seq[1:][answer] == digits).all()


def test_sequence_rejects_impossible_requests():
    with pytest.raises(ValueError, match="length >= 13"):
        S.passkey_sequence(12, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="depth"):
        S.passkey_sequence(40, 1.5, np.random.default_rng(0))


def test_training_labels_ignore_only_the_random_key_digits():
    seq = S.passkey_sequence(50, 0.4, np.random.default_rng(3))
    tokens, labels = S.training_example(seq)
    k = S.key_position(seq)
    ignored = np.flatnonzero(labels == IGNORE_INDEX)
    assert ignored.tolist() == list(range(k, k + S.DIGITS))
    keep = labels != IGNORE_INDEX
    assert (labels[keep] == seq[1:][keep]).all() and (tokens == seq[:-1]).all()


def batches(ds, n):
    return [b for _, b in zip(range(n), ds)]


def test_loader_streams_are_deterministic_split_by_rank_and_resumable():
    one = batches(S.PasskeyBatches(32, 4, seed=5), 4)  # 16 samples
    again = batches(S.PasskeyBatches(32, 4, seed=5), 4)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(one, again))
    assert not torch.equal(one[0]["tokens"], batches(S.PasskeyBatches(32, 4, seed=6), 1)[0]["tokens"])
    stream = torch.cat([b["tokens"] for b in one])  # global samples 0..15
    r0 = torch.cat([b["tokens"] for b in batches(S.PasskeyBatches(32, 2, 0, 2, seed=5), 4)])
    r1 = torch.cat([b["tokens"] for b in batches(S.PasskeyBatches(32, 2, 1, 2, seed=5), 4)])
    assert torch.equal(r0, stream[0::2]) and torch.equal(r1, stream[1::2])
    resumed = batches(S.PasskeyBatches(32, 4, seed=5, start_sample=8), 2)
    assert torch.equal(torch.cat([b["tokens"] for b in resumed]), stream[8:])
    b = one[0]
    assert b["position_ids"].tolist() == [list(range(32))] * 4 and int(b["skipped"]) == 0
    val = batches(S.PasskeyBatches(32, 4, seed=5, split="val"), 1)[0]
    assert not torch.equal(val["tokens"], b["tokens"])


def test_loader_is_independent_of_worker_count():
    plain = batches(S.build_loader("passkey", "train", 24, 2, 0, 1, seed=1), 4)
    workers = batches(S.build_loader("passkey", "train", 24, 2, 0, 1, seed=1, num_workers=2), 4)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(plain, workers))


def test_source_dir_manifest_feeds_the_data_contract(tmp_path):
    from goat_dist.config import Config
    from goat_dist.data.contract import data_contract

    path = S.source_dir("passkey", tmp_path)
    contract = data_contract(Config(), [{"path": str(path), "weight": 1.0}])
    assert contract["sources"][0]["manifest"] and contract["seq_len"] == Config().model.seq_len
    with pytest.raises(ValueError, match="passkey"):
        S.source_dir("needle", tmp_path)


def test_eval_cells_are_reproducible_and_distinct():
    a, b = cell_samples(64, 0.5, 3, seed=0), cell_samples(64, 0.5, 3, seed=0)
    assert np.array_equal(a, b) and a.shape == (3, 65)
    assert not np.array_equal(a, cell_samples(64, 0.1, 3, seed=0))
    keys = {tuple(row[-S.DIGITS :]) for row in cell_samples(64, 0.5, 20, seed=0)}
    assert len(keys) > 15


@pytest.mark.slow
def test_train_on_passkey_then_evaluate_it(tmp_path):
    """data.synthetic=passkey trains and validates like any source; eval passkey knows the training task."""
    import json
    import sys

    from harness.multiproc import goat_train_command, records, run

    run_dir, out = tmp_path / "run", tmp_path / "eval"
    run(goat_train_command(1, [
        "data.synthetic=passkey", "model.vocab_size=64", "train.max_steps=6", "train.eval_interval=6",
        f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run_dir}",
    ]))  # fmt: skip
    recs = records(run_dir)
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["epoch"] == 0.0
    assert any("val_loss" in r for r in recs)
    proc = run([sys.executable, "-m", "goat_dist", "eval", "passkey", "--checkpoint", str(run_dir),
                "--lengths", "64,96", "--depths", "0.5", "--samples", "2", "--out", str(out)])  # fmt: skip
    report = json.loads((out / "passkey.json").read_text())
    assert report["trained_on_passkey"] and report["lengths"] == [64, 96] and len(report["accuracy"]) == 2
    assert "not trained" not in proc.stdout and (out / "passkey.png").stat().st_size > 1000
