"""Sink diagnostics: the probabilities are the model's own attention, and the statistics are theirs."""

from __future__ import annotations

import pytest
import torch
from harness.models import tiny_model_config

from goat_dist.goat import split_grouped_qkv
from goat_dist.observe.attention_stats import AttentionProbe, attention_probabilities

L = 80  # longer than the 64-key window, so the statistics are not trivial


def small_model(position: str, backend: str = "sdpa"):
    from goat_dist.model import GPT

    torch.manual_seed(0)
    cfg = tiny_model_config(
        vocab_size=256, seq_len=L, num_kv_heads=2, position=position, attention_backend=backend
    )
    return GPT(cfg).eval()


def capture_layer(model, layer: int, tokens, positions):
    """The attention's qkv output and its output before the projection, from a plain forward pass."""
    attn, seen = model.blocks[layer].attn, {}
    hooks = [
        attn.qkv.register_forward_hook(lambda m, a, o: seen.__setitem__("mixed", o[0].transpose(0, 1))),
        attn.proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0].transpose(0, 1))),
    ]
    with torch.no_grad():
        model(tokens, positions)
    for h in hooks:
        h.remove()
    return attn, seen


@pytest.mark.parametrize(
    "position,backend",
    [("goat", "sdpa"), ("goat", "eager"), ("rope", "sdpa"), ("alibi", "sdpa"), ("none", "sdpa")],
)
def test_probabilities_reproduce_the_attention_output(world1, position, backend):
    model = small_model(position, backend)
    tokens = torch.randint(0, 256, (2, L))
    positions = torch.arange(L).repeat(2, 1)
    attn, seen = capture_layer(model, 1, tokens, positions)
    q, k, v = split_grouped_qkv(
        seen["mixed"], attn.local_kv_heads, attn.group, attn.content_dim, attn.head_dim
    )
    chunks = [p for _, p in attention_probabilities(attn, q, k, positions, key_chunk=30)]
    probs = torch.cat(chunks, dim=-1)  # (B, L, H, L)
    assert attn.backend == backend  # restored
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, L, 4), atol=1e-5, rtol=0)
    assert probs.permute(0, 2, 1, 3).triu(1).abs().max() < 1e-7  # no future keys
    mixed = torch.einsum("blhs,bshd->blhd", probs, v.repeat_interleave(attn.group, dim=2))
    torch.testing.assert_close(mixed.reshape(seen["out"].shape), seen["out"], atol=1e-5, rtol=1e-4)


def test_probe_statistics_equal_their_definitions(world1):
    model = small_model("goat")
    tokens = torch.randint(0, 256, (3, L))
    positions = torch.arange(L).repeat(3, 1)
    attn, seen = capture_layer(model, 0, tokens, positions)
    q, k, _ = split_grouped_qkv(
        seen["mixed"], attn.local_kv_heads, attn.group, attn.content_dim, attn.head_dim
    )
    p = torch.cat([c for _, c in attention_probabilities(attn, q[:2], k[:2], positions[:2])], -1)[:, 64:]
    i = torch.arange(64, L)[:, None]
    j = torch.arange(L)[None, :]
    expected = {
        "attn_sink_mass": float(p[..., 0].mean()),
        "attn_entropy": float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean()),
        "attn_local_mass": float((p * (j > i - 64)[None, :, None, :]).sum(-1).mean()),
    }
    with AttentionProbe(model, sequences=2) as probe, torch.no_grad():
        model(tokens, positions)
        model(tokens.flip(0), positions)  # a second pass is not measured
    stats = probe.result()
    assert set(stats) == set(expected) and all(len(v) == 2 for v in stats.values())
    for key, value in expected.items():
        assert stats[key][0] == pytest.approx(value, rel=1e-4, abs=1e-6)
    assert 0 < stats["attn_sink_mass"][0] < stats["attn_local_mass"][0] < 1
    assert all(not h for h in (attn._forward_pre_hooks, attn.qkv._forward_hooks))  # hooks removed


def test_probe_sees_a_sink():
    """A layer whose keys all equal key 0's, except key 0 scaled up, puts its mass on token 0."""
    from goat_dist.observe.attention_stats import layer_sums

    class Flat:
        local_kv_heads, group, content_dim, head_dim, backend = 1, 1, 4, 4, "eager"

        @staticmethod
        def _attend(q, k, v, position_ids, segments=None):
            logits = torch.einsum("blhd,bshd->bhls", q, k)
            logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            return torch.einsum("bhls,bshd->blhd", logits.softmax(-1), v)

    q = torch.ones(1, L, 1, 4)
    k = torch.zeros(1, L, 1, 4)
    k[:, 0] = 10.0
    mixed = torch.cat([q, k, torch.zeros(1, L, 1, 4)], dim=-1).reshape(1, L, 12)
    sink, entropy, local, rows = layer_sums(Flat(), mixed, torch.arange(L)[None], None)
    assert rows == L - 64
    assert sink / rows > 0.99 and entropy / rows < 0.1 and local / rows < 0.01
