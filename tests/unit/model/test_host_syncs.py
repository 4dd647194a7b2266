"""A model told that rows hold one sequence each (``documents=False``: ``data.document_masking`` off) never
looks for packed documents, which reads a value on the host per micro-batch; one that may see packed
documents does, and the two agree wherever positions never restart."""

from __future__ import annotations

import torch

from goat_dist.config import ModelConfig
from goat_dist.model import gpt
from goat_dist.parallel import context


def config() -> ModelConfig:
    return ModelConfig(vocab_size=300, seq_len=32, num_layers=2, hidden_size=64, num_heads=4,
                       num_kv_heads=2, attention_backend="sdpa")  # fmt: skip


def batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], torch.arange(cfg.seq_len).expand(2, -1), tokens[:, 1:]


def test_no_document_search_without_document_masking(world1, monkeypatch):
    cfg = config()
    torch.manual_seed(0)
    searching = gpt.GPT(cfg)
    torch.manual_seed(0)
    plain = gpt.GPT(cfg, documents=False)
    expected = searching(*batch(cfg))
    calls = []
    real = gpt.document_segments
    monkeypatch.setattr(gpt, "document_segments", lambda p: calls.append(p) or real(p))
    assert torch.equal(plain(*batch(cfg)), expected) and calls == []
    searching(*batch(cfg))
    assert len(calls) == 1  # once per forward, not per layer


def test_the_context_parallel_shard_skips_it_too(monkeypatch):
    positions = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, -1)  # two documents per row
    monkeypatch.setattr(context, "document_segments", lambda p: (_ for _ in ()).throw(AssertionError))
    assert context.make_shard(positions, cp=2, rank=0, documents=False).segments is None
    monkeypatch.undo()
    assert context.make_shard(positions, cp=2, rank=0).segments is not None


def test_the_trainer_builds_the_model_from_data_document_masking():
    from pathlib import Path

    source = (Path(gpt.__file__).parents[1] / "trainer" / "trainer.py").read_text()
    assert "documents=cfg.data.document_masking" in source
