"""bf16 at long positions: the output error must not grow with the absolute position.

The reference stores ``slope * t_j`` as one bf16 lane, so its error grows from ~1e-2 at position 0 to
~0.5 at 131072; ours measures the recency and the relative phases from the sequence's first position.
"""

from __future__ import annotations

import copy

import pytest
import torch

from goat_dist.attention import GoatSelfAttention, flash_available, from_reference

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
