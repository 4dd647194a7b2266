"""The megatron-core GPT against a plain PyTorch GPT of the same architecture, written here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness.models import tiny_model_config

from goat_dist.config import ModelConfig
from goat_dist.model import GPT


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, base):
    """Rotate-half RoPE on (B, H, L, D), written out directly from the definition."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double()[:, None, :, None] * inv  # (B, 1, L, D/2)
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def plain_gpt_logits(model: GPT, cfg: ModelConfig, tokens, positions):
    """Forward pass of a textbook pre-norm GPT using the weights of ``model`` (TP=1)."""
    sd = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    H, KV = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    D = cfg.hidden_size // H
    B, L = tokens.shape
    x = sd["embedding.weight"][tokens]
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        h = rms_norm(x, sd[p + "attn_norm.weight"], cfg.norm_eps)
        w = sd[p + "attn.qkv.weight"].view(KV, (H // KV + 2) * D, cfg.hidden_size)
        wq = w[:, : (H // KV) * D].reshape(H * D, -1)
        wk = w[:, (H // KV) * D : (H // KV + 1) * D].reshape(KV * D, -1)
        wv = w[:, (H // KV + 1) * D :].reshape(KV * D, -1)
        q = (h @ wq.T).view(B, L, H, D).transpose(1, 2)
        k = (h @ wk.T).view(B, L, KV, D).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        v = (h @ wv.T).view(B, L, KV, D).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        if cfg.position == "rope":
            q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + att.transpose(1, 2).reshape(B, L, H * D) @ sd[p + "attn.proj.weight"].T
        h = rms_norm(x, sd[p + "mlp_norm.weight"], cfg.norm_eps)
        gate_up = h @ sd[p + "mlp.fc1.weight"].T
        gate, up = gate_up.chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.fc2.weight"].T
    x = rms_norm(x, sd["final_norm.weight"], cfg.norm_eps)
    return (x @ sd["embedding.weight"].T)[..., : cfg.vocab_size]


@pytest.mark.parametrize("position", ["none", "rope"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_gpt_matches_plain_pytorch(world1, position, kv_heads):
    cfg = tiny_model_config(
        vocab_size=500, seq_len=48, num_kv_heads=kv_heads, position=position, attention_backend="sdpa"
    )
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    positions = torch.arange(cfg.seq_len).expand(2, -1) + torch.tensor([[0], [1000]])
    with torch.no_grad():
        ours = model(tokens, positions)[..., : cfg.vocab_size]
        ref = plain_gpt_logits(model, cfg, tokens, positions)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_padded_vocab_gets_no_probability(world1):
    cfg = ModelConfig(
        vocab_size=300,
        seq_len=16,
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        position="goat",
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.padded_vocab == 384
    logits = model(torch.randint(0, 300, (1, 16)), torch.arange(16)[None])
    probs = logits.softmax(-1)
    assert probs[..., 300:].abs().max().item() == 0.0
    assert torch.allclose(probs[..., :300].sum(-1), torch.ones(1, 16))


def test_per_head_prior_parameters_are_tagged_tensor_parallel(world1):
    """Grad-norm clipping counts a parameter once per TP rank only if megatron's attributes say it is split:
    the per-head prior parameters are (split with the heads), the shared sink MLP is not."""
    cfg = ModelConfig(vocab_size=300, seq_len=16, num_layers=1, hidden_size=32, num_heads=2, position="goat")
    prior = GPT(cfg).blocks[0].attn.prior
    for name, p in prior.named_parameters():
        split = not name.startswith("sink_mlp.")
        assert getattr(p, "tensor_model_parallel", False) is split, name
        if split:
            assert (p.partition_dim, p.partition_stride) == (0, 1), name


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_alibi_slopes_follow_press_et_al_and_build_on_meta(heads):
    """Geometric slopes 2^(-8i/n) for a power of two; otherwise the closest power's slopes, then every other
    slope of twice that count (the ALiBi paper's rule). Plain floats: a meta default device works."""
    from goat_dist.goat.prior import alibi_slopes

    def geometric(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]

    closest = 2 ** math.floor(math.log2(heads))
    expected = geometric(closest) + geometric(2 * closest)[0::2][: heads - closest]
    assert torch.allclose(alibi_slopes(heads), torch.tensor(expected), rtol=0, atol=1e-7)
    with torch.device("meta"):
        assert alibi_slopes(heads).device.type == "cpu"
