"""GOAT, ALiBi, RoPE, NoPE and learned positions built with the same seed start from the same weights
everywhere but GOAT's prior (and the learned table): embeddings, v, o, MLP, norms, and the content rows
of q and k, each GOAT q/k head being the first ``d_c`` rows of the other schemes' full-width head (the
reference's layout: content first, the prior's lanes last). A comparison of position schemes then
measures the schemes, not two draws of the initial weights.

The q/k rows are compared through an independent reading of the fused layout (per KV group ``group``
q heads, one k, one v), not through ``shapes.qkv_row_spans``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness.models import tiny_model_config

from goat_dist.config import GoatConfig, ModelConfig
from goat_dist.model import GPT
from goat_dist.shapes import head_dims


def built(position: str, kv_heads: int, lanes, bias: bool = False) -> tuple[ModelConfig, dict]:
    cfg = tiny_model_config(
        seq_len=16, num_kv_heads=kv_heads, position=position, bias=bias, goat=GoatConfig(key_bias_lanes=lanes)
    )
    torch.manual_seed(0)
    return cfg, {n: p.detach() for n, p in GPT(cfg).named_parameters()}


def heads_of(weight: torch.Tensor, cfg: ModelConfig) -> tuple[list, list, list]:
    """(q heads, k heads, v heads) of a fused q/k/v weight (or bias), each ``(rows, ...)``."""
    heads, kv, head_dim, content = head_dims(cfg)
    group = heads // kv
    per = weight.view(kv, (group + 1) * content + head_dim, *weight.shape[1:])
    q, k, v = [], [], []
    for g in range(kv):
        rows = per[g]
        q += [rows[i * content : (i + 1) * content] for i in range(group)]
        k.append(rows[group * content : (group + 1) * content])
        v.append(rows[(group + 1) * content :])
    return q, k, v


@pytest.mark.parametrize("other", ["alibi", "rope", "none", "learned"])
@pytest.mark.parametrize("kv_heads,lanes", [(4, "auto"), (2, 1)], ids=["mha-3lanes", "gqa-1lane"])
def test_schemes_share_every_weight_but_the_prior(world1, other, kv_heads, lanes):
    goat_cfg, goat = built("goat", kv_heads, lanes, bias=True)
    other_cfg, plain = built(other, kv_heads, lanes, bias=True)
    content = head_dims(goat_cfg)[3]
    assert content < head_dims(other_cfg)[2]  # the lanes really narrow GOAT's q/k
    only_goat = {n for n in goat if n not in plain}
    assert only_goat and all(".attn.prior." in n for n in only_goat)
    compared = 0
    for name, p in plain.items():
        if name == "pos_embedding.weight":
            continue
        if ".attn.qkv." in name:
            gq, gk, gv = heads_of(goat[name], goat_cfg)
            pq, pk, pv = heads_of(p, other_cfg)
            for mine, theirs in zip(gq + gk, pq + pk, strict=True):
                assert torch.equal(mine, theirs[:content]), name  # content rows: the leading rows
            assert all(torch.equal(a, b) for a, b in zip(gv, pv, strict=True)), name
        else:
            assert torch.equal(goat[name], p), name
        compared += 1
    assert compared >= 2 * 9  # norms, qkv (weight, bias), proj, fc1, fc2 of both blocks, and more


def test_lane_count_changes_only_how_many_q_k_rows_goat_keeps(world1):
    """The 2R+1 (fp32) and 2R+3 (bf16) layouts start from the same weights too: the narrower one's
    q/k heads are the leading rows of the wider one's."""
    one_cfg, one = built("goat", 2, 1)
    three_cfg, three = built("goat", 2, 3)
    for name, p in one.items():
        if name.endswith("attn.qkv.weight"):
            (q1, k1, v1), (q3, k3, v3) = heads_of(p, one_cfg), heads_of(three[name], three_cfg)
            content = q3[0].shape[0]
            assert all(torch.equal(a[:content], b) for a, b in zip(q1 + k1, q3 + k3, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(v1, v3, strict=True))
        else:
            assert torch.equal(p, three[name]), name


def test_sink_init_std_scales_the_sink_mlps_initial_weights(world1):
    """``model.goat.sink_init_std`` (default 1e-3, the authors' C4 script) is the std of the sink MLP's
    weights: the same draws, scaled; nothing else changes."""
    assert GoatConfig().sink_init_std == 1e-3
    base_cfg, base = built("goat", 4, "auto")
    cfg = dataclasses.replace(base_cfg, goat=GoatConfig(sink_init_std=3e-3))
    torch.manual_seed(0)
    scaled = {n: p.detach() for n, p in GPT(cfg).named_parameters()}
    sink = [n for n in base if ".sink_mlp." in n and n.endswith("weight")]
    assert sink
    for name, p in base.items():
        if name in sink:
            assert torch.allclose(scaled[name], 3 * p, rtol=1e-6, atol=0) and p.abs().max() < 1e-2, name
        else:
            assert torch.equal(scaled[name], p), name
