"""bf16 at long positions and long sequences: the output error must grow neither with the absolute
position nor with the sequence length, and must stay that of plain bf16 attention.

The reference stores ``slope * t_j`` as one bf16 lane, so its error grows from ~1e-2 at position 0 to
~0.5 at 131072; a single lane holding ``slope * (t_j - origin)`` still grows with the length (0.5 at
L=4096 from position 0). Ours measures the recency from the middle of the sequence's positions and
carries the per-key value in three lanes bf16 holds exactly (``goat_dist/goat/exact.py``); the
lane-level check is ``test_attention_lanes.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from harness.flash_standin import FlashStandin, installed

from goat_dist.goat import GoatSelfAttention, from_reference
from goat_dist.kernels import flash_available

L = 256


def bf16_error(mod, x, offset, causal=True):
    pos = torch.arange(L) + offset
    with torch.no_grad():
        exact = mod(x, pos, causal=causal)
        low = copy.deepcopy(mod).to(torch.bfloat16)(x.bfloat16(), pos, causal=causal)
    return (low.float() - exact).abs().max().item()


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_bf16_error_flat_in_position(backend):
    torch.manual_seed(0)
    mod = GoatSelfAttention(256, 8, 4, pos_rank=4, abs_rank=4, training_seq_len=1024, backend=backend)
    x = torch.randn(2, L, 256)
    err0 = bf16_error(mod, x, 0)
    for offset in (2048, 131072 - L, 131072):
        err = bf16_error(mod, x, offset)
        assert err <= 2 * err0, f"bf16 error {err:.3e} at offset {offset} vs {err0:.3e} at 0"
    assert err0 < 0.05


def test_prior_stays_fp32_under_bf16_cast():
    mod = GoatSelfAttention(64, 4, pos_rank=2, abs_rank=2).to(torch.bfloat16)
    assert mod.qkv.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in mod.prior.parameters())


def test_reference_bf16_error_grows_with_position():
    """The same measurement on the reference shows the failure the test above guards against."""
    goat = pytest.importorskip("goat.attention")
    torch.manual_seed(0)
    ref = goat.GoatAttention(
        embed_dim=256,
        num_heads=8,
        kv_num_heads=4,
        pos_rank=4,
        abs_rank=4,
        training_seq_len=1024,
        batch_first=True,
    )
    x = torch.randn(2, L, 256)

    def ref_err(offset):
        with torch.no_grad():
            kw = dict(is_causal=True, need_weights=False, position_offset_q=offset, position_offset_k=offset)
            exact, _ = ref(x, x, x, **kw)
            xb = x.bfloat16()
            low, _ = copy.deepcopy(ref).to(torch.bfloat16)(xb, xb, xb, **kw)
        return (low.float() - exact).abs().max().item()

    assert ref_err(131072) > 5 * ref_err(0)
    ours = from_reference(ref, backend="sdpa")
    assert bf16_error(ours, x, 131072) <= 2 * bf16_error(ours, x, 0)


def test_bf16_error_at_length_8192_within_2x_plain_attention():
    """At L=8192 from position 0, GOAT's bf16 output error through its lanes, as flash-attn computes
    them (the CPU stand-in: bf16 inputs, fp32 logits and softmax, bf16 probabilities), is at most twice
    that of plain bf16 attention with the same projections, both measured against float64."""
    goat = pytest.importorskip("goat.attention")
    torch.manual_seed(0)
    ref = goat.GoatAttention.for_gpt(64, 1, pos_rank=4, abs_rank=4)  # head dim 64, one head: seconds
    with torch.no_grad():  # the steepest seeded slope of for_gpt(256, 4, ...) (1/4), not one head's 1/256
        ref.recency_slope_raw.fill_(math.log(math.expm1(0.25)))
    mod = from_reference(ref, backend="sdpa")
    L = 8192
    x = torch.randn(1, L, 64)
    pos = torch.arange(L)
    standin = FlashStandin()

    def plain(m, xx):  # the reference's full q/k/v projections, causal softmax attention
        q, k, v = m.in_proj(xx).view(1, L, 3, 1, 64).unbind(2)
        if xx.dtype == torch.float64:
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        else:
            out = standin.flash_attn_func(q, k, v, causal=True)
        return m.out_proj(out.reshape(1, L, 64))

    with torch.no_grad(), installed(standin):
        goat_exact = copy.deepcopy(mod).double()(x.double(), pos)
        low = copy.deepcopy(mod).bfloat16()
        low.backend = "flash"
        goat_err = (low(x.bfloat16(), pos).double() - goat_exact).abs().max().item()
        plain_exact = plain(copy.deepcopy(ref).double(), x.double())
        plain_err = (
            (plain(copy.deepcopy(ref).bfloat16(), x.bfloat16()).double() - plain_exact).abs().max().item()
        )
    assert standin.calls.count("flash_attn_func") == 2
    assert goat_err <= 2 * plain_err, f"GOAT bf16 error {goat_err:.3e} vs plain attention {plain_err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not flash_available(), reason="needs CUDA and flash-attn")
def test_flash_matches_sdpa_on_gpu():
    torch.manual_seed(0)
    sdpa = GoatSelfAttention(512, 8, 2, pos_rank=4, abs_rank=4, backend="sdpa").cuda().to(torch.bfloat16)
    flash = copy.deepcopy(sdpa)
    flash.backend = "flash"
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    for offset in (0, 100000):
        pos = torch.arange(1024, device="cuda") + offset
        a, b = sdpa(x, pos), flash(x, pos)
        assert (a.float() - b.float()).abs().max().item() < 2e-2
