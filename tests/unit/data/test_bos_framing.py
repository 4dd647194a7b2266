"""BOS framing (``data.bos_framing``, ``goat_dist/data/framing.py``): every training, validation and
evaluation window is the data set's BOS and ``seq_len - 1`` corpus tokens, the BOS predicting the first
corpus token and no position predicting a BOS, with the exact resume the unframed stream has."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from harness.batches import batches, consecutive_splits, same  # the loader tests' helpers

from data_tools.shard_format import TOKENIZER_NAME, write_manifest
from goat_dist.data import framing
from goat_dist.data.loader import IGNORE_INDEX, build_train_loader, build_val_loader
from goat_dist.data.sources import resolve_sources
from goat_dist.evaluation import perplexity, reports

VOCAB = 60_000
FIRST = 1000  # corpus ids are FIRST, FIRST + 1, ... in stream order: no corpus token is a BOS or EOS
BOS, EOS = 1, 2
L = 16


def template_tokenizer(bos: int | None) -> dict:
    """A tokenizer.json whose post-processor puts ``<s>`` (id ``bos``) before a sequence, or none."""
    if bos is None:
        return {"version": "1.0", "post_processor": {"type": "ByteLevel"}}
    post = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    return {"version": "1.0", "post_processor": post}


def make_dataset(root: Path, shard_mb: float, bos: int | None = BOS, n_docs: int = 40) -> Path:
    """Documents of random lengths holding consecutive ids from FIRST, so a window's tokens name their
    stream offsets; 4 val documents; a tokenizer file declaring ``bos`` (None: none)."""
    rng = np.random.default_rng(0)
    counts = {"train": n_docs, "val": 4}
    splits, _ = consecutive_splits(root, counts, rng, (20, 200), shard_mb, VOCAB, first=FIRST, key_digits=6)
    manifest = {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "eos_id": EOS}
    write_manifest(root, {**manifest, "splits": splits})
    (root / TOKENIZER_NAME).write_text(json.dumps(template_tokenizer(bos)))
    return root


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("one"), 1.0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The same documents in ~8 train shards: shuffled shard order, windows across shard ends."""
    return make_dataset(tmp_path_factory.mktemp("many"), 0.001)


def loader(path, **kw):
    kw = {
        "seq_len": L,
        "micro_batch_size": 4,
        "dp_rank": 0,
        "dp_size": 1,
        "seed": 5,
        "bos_framing": True,
        **kw,
    }
    return build_train_loader([str(path)], **kw)


def test_window_is_bos_then_seq_len_minus_one_corpus_tokens(one_shard):
    """In stream order (one shard, no shuffle) sample n holds stream tokens n(L-1) .. n(L-1) + L - 1."""
    (batch,) = batches(loader(one_shard, shuffle_buffer=0), 1)
    tokens, labels = batch["tokens"], batch["labels"]
    assert tokens.shape == labels.shape == (4, L)
    start = FIRST + torch.arange(4)[:, None] * (L - 1)
    assert torch.equal(tokens[:, 0], torch.full((4,), BOS))
    assert torch.equal(tokens[:, 1:], start + torch.arange(L - 1))  # L - 1 corpus tokens after the BOS
    assert torch.equal(labels, start + torch.arange(L))  # the BOS predicts the first; the last, the next
    assert torch.equal(batch["position_ids"], torch.arange(L).expand(4, L))
    (plain,) = batches(loader(one_shard, shuffle_buffer=0, bos_framing=False), 1)
    assert torch.equal(plain["tokens"][:, 0], FIRST + torch.arange(4) * L)  # unframed: stride L, no BOS


def test_shuffled_windows_are_framed_and_no_label_is_a_bos(shards):
    for batch in batches(loader(shards, shuffle_buffer=64), 6):
        tokens, labels = batch["tokens"], batch["labels"]
        assert (tokens[:, 0] == BOS).all() and (tokens[:, 1:] != BOS).all()
        assert torch.equal(labels[:, :-1], tokens[:, 1:])  # each position predicts the next input
        assert (labels >= FIRST).all()  # corpus tokens only: nothing predicts a BOS


def test_exact_resume_with_framing(shards):
    """Resumed at sample S, on the same or another dp size, the rest of the same framed stream (framing
    is per sample: the worker count changes nothing, as for the unframed stream)."""
    whole = batches(loader(shards, micro_batch_size=2), 8)  # 16 samples at dp 1
    assert same(batches(loader(shards, micro_batch_size=2, start_sample=8), 4), whole[4:])
    ranks = [
        batches(loader(shards, micro_batch_size=1, dp_rank=r, dp_size=2, start_sample=8), 4) for r in (0, 1)
    ]
    rows = [ranks[r][k]["tokens"][0] for k in range(4) for r in (0, 1)]  # samples 8, 9, ..., 15
    assert torch.equal(torch.stack(rows), torch.cat([b["tokens"] for b in whole[4:]]))


def test_validation_windows_are_framed(shards):
    (batch,) = batches(build_val_loader([str(shards)], L, 2, 0, 1, bos_framing=True), 1)
    assert (batch["tokens"][:, 0] == BOS).all() and torch.equal(
        batch["labels"][:, :-1], batch["tokens"][:, 1:]
    )


def test_the_bos_is_the_tokenizers_else_the_eos(tmp_path):
    """The manifest's bos_id, else the token the tokenizer file puts first, else the data set's EOS; a
    data set without its tokenizer file is refused (elsewhere it would frame another token)."""
    path = make_dataset(tmp_path / "template", 1.0, n_docs=2)
    (split,) = resolve_sources([str(path)], "train")
    assert framing.bos_id(split) == BOS
    gpt2 = make_dataset(tmp_path / "gpt2", 1.0, bos=None, n_docs=2)
    assert framing.bos_id(resolve_sources([str(gpt2)], "train")[0]) == EOS
    bert = {"type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}
    assert framing.prepended_token({"type": "Sequence", "processors": [{"type": "ByteLevel"}, bert]}) == 101
    recorded = tmp_path / "recorded"
    make_dataset(recorded, 1.0, n_docs=2)
    manifest = json.loads((recorded / "manifest.json").read_text())
    (recorded / "manifest.json").write_text(json.dumps({**manifest, "bos_id": 7}))
    assert framing.bos_id(resolve_sources([str(recorded)], "train")[0]) == 7
    (path / TOKENIZER_NAME).unlink()
    framing._bos_id.cache_clear()
    with pytest.raises(ValueError, match="tokenizer file .* is missing"):
        framing.bos_id(split)


def test_unreadable_tokens_mask_the_labels_they_touch():
    """Framed, input t >= 1 is stream token t - 1 and target t is token t: a missing token k masks the
    labels of positions k and k + 1; the BOS is never missing."""
    missing = np.zeros(6, dtype=bool)
    missing[2] = True
    assert framing.unreadable(missing, framed=True).tolist() == [False, False, True, True, False, False]
    assert framing.unreadable(missing, framed=False).tolist() == [False, True, True, False, False]
    with pytest.raises(ValueError, match=">= 2 tokens"):
        framing.stride(1, True)


def test_evaluation_windows_are_framed_like_training(one_shard, monkeypatch):
    """``eval ppl`` of a run trained framed (its config says so) cuts BOS + length - 1 corpus tokens."""
    seen = []

    def losses(model, tokens, positions, labels):
        seen.append((tokens.clone(), labels.clone()))
        return torch.zeros(tokens.shape) * (labels != IGNORE_INDEX)

    monkeypatch.setattr(perplexity, "token_losses", losses)
    monkeypatch.setattr(perplexity.collectives, "all_reduce", lambda t, group=None: t)
    model = SimpleNamespace(
        cfg=SimpleNamespace(position="goat", seq_len=L),
        layout=SimpleNamespace(dp=1, dp_rank=0, dp_group=None),
    )
    cpu = torch.device("cpu")
    result = perplexity.perplexity_at(
        model, str(one_shard), "train", L, 3 * L, 2 * L, cpu, contextlib.nullcontext, L, bos_framing=True
    )
    assert result["bos_framing"] and result["windows"] == 3 and result["tokens"] == 3 * L
    tokens = torch.cat([t for t, _ in seen])[:3]
    labels = torch.cat([lb for _, lb in seen])[:3]
    start = FIRST + torch.arange(3)[:, None] * (L - 1)
    assert (tokens[:, 0] == BOS).all() and torch.equal(tokens[:, 1:], start + torch.arange(L - 1))
    assert torch.equal(labels, start + torch.arange(L))
    assert reports.trained_framed(SimpleNamespace(run_config={"data": {"bos_framing": True}}))
    assert not reports.trained_framed(SimpleNamespace(run_config=None))  # an export: unframed


def test_config_refuses_framing_where_it_has_no_meaning():
    from goat_dist.config import ConfigError, load_config

    assert load_config(None, ["data.bos_framing=true"]).data.bos_framing
    for other in ("data.document_masking=true", "data.synthetic=passkey", "model.seq_len=1"):
        with pytest.raises(ConfigError, match="data.bos_framing"):
            load_config(None, ["data.bos_framing=true", other])
