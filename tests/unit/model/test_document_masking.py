"""Packed documents: with positions restarting per document, attention stays inside each document, so
the logits of a packed row equal the logits of every document run alone (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from harness.models import tiny_model_config

from goat_dist.kernels import document_segments
from goat_dist.model import GPT


@pytest.mark.parametrize("position", ["goat", "rope", "alibi", "none"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_row_equals_documents_alone(world1, position, backend):
    cfg = tiny_model_config(seq_len=64, num_kv_heads=2, position=position, attention_backend=backend)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    # a document continued from a previous window (positions 7..21), then two fresh ones
    lengths, first_positions = [15, 30, 19], [7, 0, 0]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(first_positions, lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, positions)
        start = 0
        for n, p in zip(lengths, first_positions):
            alone = model(tokens[:, start : start + n], torch.arange(p, p + n)[None])
            V = cfg.vocab_size
            err = (packed[:, start : start + n, :V] - alone[..., :V]).abs().max().item()
            assert err <= 1e-5, f"document at {start}: {err:.2e}"
            start += n


def test_segments_from_positions():
    pos = torch.tensor([[5, 6, 7, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_segments(pos).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]
    assert document_segments(torch.arange(10)[None] + 1000) is None
