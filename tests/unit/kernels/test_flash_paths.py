"""The project's flash-attn code paths, run on CPU through the stand-in of ``tests/harness/flash_standin.py``.

First the stand-in itself is checked against attention written out explicitly in float64 (its layouts,
bottom-right causal alignment, ALiBi, log-sum-exp, varlen packing) and against the kernel's rejections.
Then GOAT (causal, GQA, several R/M, q/k wider than v), packed documents (varlen) and ALiBi take the
``flash`` backend with the stand-in in fp32 and must match ``sdpa`` to 1e-5, outputs and gradients.
On a GPU the real kernel is imported instead (``test_attention_bf16.py::test_flash_matches_sdpa_on_gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch
from harness.backend_checks import (
    GOAT_CASES,
    assert_goat_backend_matches_sdpa,
    assert_grads_close,
    model_pair,
)
from harness.flash_standin import FlashStandin, installed

from goat_dist.kernels import resolve_backend


@pytest.fixture
def flash32():
    """The stand-in, fp32 allowed (exact comparisons), installed as ``flash_attn`` for one test."""
    with installed(FlashStandin(allow_fp32=True)) as standin:
        yield standin


def explicit_attention(q, k, v, scale, causal, slopes=None):
    """Float64 attention for one sequence, q (Lq, H, D), k/v (Lk, H_kv, D): (out, lse (H, Lq))."""
    Lq, H, _ = q.shape
    Lk, Hk, _ = k.shape
    k, v = k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
    logits = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    i = torch.arange(Lq)[:, None] + (Lk - Lq)  # bottom-right alignment, from the flash-attn docs
    j = torch.arange(Lk)[None, :]
    if slopes is not None:
        logits = logits - slopes.double()[:, None, None] * (i - j).abs()
    if causal:
        logits = logits.masked_fill(j > i, -math.inf)
    lse = torch.logsumexp(logits, -1)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]))  # an empty row -> zeros
    return torch.einsum("hij,jhd->ihd", probs, v), lse


# ---- the stand-in against explicit attention -----------------------------------------------------------
@pytest.mark.parametrize("Lq,Lk", [(7, 7), (2, 5), (5, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
def test_standin_func_matches_explicit(flash32, Lq, Lk, causal, alibi):
    torch.manual_seed(0)
    B, H, Hk, D = 2, 4, 2, 16
    q, k, v = torch.randn(B, Lq, H, D), torch.randn(B, Lk, Hk, D), torch.randn(B, Lk, Hk, D)
    slopes = torch.rand(B, H) if alibi else None
    out, lse, probs = flash32.flash_attn_func(
        q, k, v, softmax_scale=0.3, causal=causal, alibi_slopes=slopes, return_attn_probs=True
    )
    assert out.shape == (B, Lq, H, D) and lse.shape == (B, H, Lq) and probs.shape == (B, H, Lq, Lk)
    for b in range(B):
        ref_out, ref_lse = explicit_attention(q[b], k[b], v[b], 0.3, causal, slopes[b] if alibi else None)
        assert (out[b].double() - ref_out).abs().max() <= 1e-5
        finite = torch.isfinite(ref_lse)
        assert (lse[b][finite].double() - ref_lse[finite]).abs().max() <= 1e-5
        assert torch.isinf(lse[b][~finite]).all() and not out[b][(~finite).all(0)].any()
    seen = probs.sum(-1)
    assert torch.allclose(seen[seen > 0], torch.ones(()), atol=1e-6)
    assert flash32.flash_attn_func(q, k, v, causal=causal).shape == out.shape  # default scale 1/sqrt(D)


@pytest.mark.parametrize("Lq,Lk", [(7, 7), (2, 5), (7, 3)])
def test_standin_query_blocks_match_explicit(flash32, monkeypatch, Lq, Lk):
    """Long sequences run in query blocks that skip fully masked keys: blocks of 3 rows give the same."""
    from goat_dist.kernels import flash_standin

    monkeypatch.setattr(flash_standin, "_QUERY_BLOCK", 3)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, Lq, 2, 8), torch.randn(1, Lk, 1, 8), torch.randn(1, Lk, 1, 8)
    slopes = torch.rand(2)
    out, lse, probs = flash32.flash_attn_func(
        q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True
    )
    ref_out, ref_lse = explicit_attention(q[0], k[0], v[0], 8**-0.5, True, slopes)
    assert (out[0].double() - ref_out).abs().max() <= 1e-5 and probs.shape == (1, 2, Lq, Lk)
    finite = torch.isfinite(ref_lse)
    assert (lse[0][finite].double() - ref_lse[finite]).abs().max() <= 1e-5 and torch.isinf(
        lse[0][~finite]
    ).all()


def test_standin_default_scale_is_inverse_sqrt_head_dim(flash32):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    ref, _ = explicit_attention(q[0], k[0], v[0], 16**-0.5, causal=True)
    assert (flash32.flash_attn_func(q, k, v, causal=True)[0].double() - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_standin_varlen_matches_explicit(flash32, causal):
    torch.manual_seed(0)
    H, Hk, D = 4, 1, 8
    len_q, len_k = [3, 6, 1], [5, 6, 4]
    q = torch.randn(sum(len_q), H, D)
    k, v = torch.randn(sum(len_k), Hk, D), torch.randn(sum(len_k), Hk, D)
    cu_q = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11, 15], dtype=torch.int32)
    slopes = torch.rand(H)
    out, lse, probs = flash32.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 6, 6, causal=causal, alibi_slopes=slopes, return_attn_probs=True
    )
    assert out.shape == q.shape and lse.shape == (H, 10) and probs.shape == (3, H, 6, 6)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse = explicit_attention(q[sq], k[sk], v[sk], D**-0.5, causal, slopes)
        assert (out[sq].double() - ref_out).abs().max() <= 1e-5
        assert (lse[:, sq].double() - ref_lse).abs().max() <= 1e-5


def test_standin_low_precision_follows_the_kernel_contract():
    """bf16: output in bf16, within bf16 rounding of the fp32 result; fp32 rejected by default."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 32) for _ in range(3))
    exact = FlashStandin(allow_fp32=True).flash_attn_func(q, k, v, causal=True)
    low = FlashStandin().flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert low.dtype == torch.bfloat16
    assert 0 < (low.float() - exact).abs().max() <= 3e-2


def test_standin_rejects_what_the_kernel_rejects():
    torch.manual_seed(0)
    strict, loose = FlashStandin(), FlashStandin(allow_fp32=True)
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    cases = {
        "fp32 without the switch": lambda: strict.flash_attn_func(q.float(), q.float(), q.float()),
        "fp64 even with it": lambda: loose.flash_attn_func(q.double(), q.double(), q.double()),
        "mixed dtypes": lambda: strict.flash_attn_func(q, q.half(), q),
        "strided last dim": lambda: strict.flash_attn_func(
            torch.randn(1, 8, 2, 32, dtype=torch.bfloat16)[..., ::2], q, q
        ),
        "head dim 264": lambda: strict.flash_attn_func(
            *(torch.randn(1, 4, 1, 264, dtype=torch.bfloat16),) * 3
        ),
        "v head dim differs": lambda: strict.flash_attn_func(q, q, q[..., :8].contiguous()),
        "H not a multiple of H_kv": lambda: strict.flash_attn_func(
            torch.randn(1, 8, 3, 16, dtype=torch.bfloat16), q, q
        ),
        "bf16 ALiBi slopes": lambda: strict.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2).bfloat16()),
        "int64 cu_seqlens": lambda: strict.flash_attn_varlen_func(
            q[0], q[0], q[0], torch.tensor([0, 8]), torch.tensor([0, 8]), 8, 8
        ),
        "max_seqlen too small": lambda: strict.flash_attn_varlen_func(
            q[0],
            q[0],
            q[0],
            torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([0, 8], dtype=torch.int32),
            4,
            4,
        ),
    }
    for name, call in cases.items():
        with pytest.raises(RuntimeError):
            call()
            pytest.fail(f"accepted: {name}")
    with pytest.raises(NotImplementedError):
        strict.flash_attn_func(q, q, q, dropout_p=0.1)


def views_of_the_125m_projection(dtype=torch.bfloat16, batch=2, length=16):
    """q, k, v as ``split_grouped_qkv`` cuts them out of the 125M config's fused projection (12 heads of
    64, GOAT's 11 lanes: content 53), in the model's [s, b, width] -> batch-first layout."""
    from goat_dist.goat import split_grouped_qkv

    heads, content, head_dim = 12, 53, 64
    width = heads * (2 * content + head_dim)
    mixed = torch.randn(length, batch, width, dtype=dtype).transpose(0, 1)
    return split_grouped_qkv(mixed, heads, 1, content, head_dim)


def test_standin_refuses_a_view_it_cannot_load_16_bytes_at_a_time():
    """The 125M config's v: 212 bytes into each row and heads 340 bytes apart in bf16. flash-attn 2
    would fault on it (misaligned address); its own wrapper passes it through (unit last stride)."""
    _, _, v = views_of_the_125m_projection()
    assert v.stride(-1) == 1 and v.storage_offset() * 2 == 212 and v.stride(2) * 2 == 340
    q = torch.randn(2, 16, 12, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="misaligned address"):
        FlashStandin().flash_attn_func(q, q, v, causal=True)
    shifted = torch.randn(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)  # contiguous, 2 bytes off
    with pytest.raises(RuntimeError, match="misaligned address"):
        FlashStandin().flash_attn_func(q, q, shifted, causal=True)
    FlashStandin().flash_attn_func(q, q, v.contiguous(), causal=True)
    odd = torch.randn(2, 16, 12, 70, dtype=torch.bfloat16)[..., :60]  # not a multiple of 8: the wrapper pads
    FlashStandin().flash_attn_func(odd, odd, odd, causal=True)


def test_flash_attention_gives_fa2_aligned_inputs(flash32):
    """The project copies what flash-attn 2 cannot load (the 125M config's v, here in fp32: 424 bytes
    in) and matches sdpa, outputs and gradients, dense and packed. q/k with GOAT's lanes appended are
    fresh tensors."""
    from goat_dist.kernels import document_segments, flash_attention, sdpa_attention

    qc, kc, v = views_of_the_125m_projection(torch.float32)
    q = torch.cat([qc, torch.randn(*qc.shape[:-1], 11)], -1).requires_grad_(True)
    k = torch.cat([kc, torch.randn(*kc.shape[:-1], 11)], -1).requires_grad_(True)
    v = v.detach().requires_grad_(True)  # still the strided view
    assert v.storage_offset() * 4 % 16
    for positions in (torch.arange(16).expand(2, 16), torch.tensor([list(range(6)) + list(range(10))] * 2)):
        segments = document_segments(positions)
        out = flash_attention(q, k, v, causal=True, scale=0.125, segments=segments)
        ref = sdpa_attention(q, k, v, causal=True, scale=0.125, segments=segments)
        assert (out - ref).abs().max().item() <= 1e-5
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        refs = torch.autograd.grad(ref.sum(), (q, k, v))
        assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(grads, refs))
    assert flash32.calls == ["flash_attn_func", "flash_attn_varlen_func"]


def test_installed_standin_is_what_the_project_imports():
    from goat_dist.kernels import flash_imports as kernels

    before = kernels._flash_attn()
    with installed(FlashStandin()) as standin:
        assert kernels._flash_attn().flash_attn_func == standin.flash_attn_func
        assert resolve_backend("flash") == "flash" and resolve_backend("auto") == "flash"
    assert kernels._flash_attn() is before  # uninstalled: the real import (None on CPU machines) again


# ---- GOAT through the flash path ------------------------------------------------------------------------
@pytest.mark.parametrize("kv,R,M,key_bias,offset,content_dim", GOAT_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_goat_flash_matches_sdpa(flash32, kv, R, M, key_bias, offset, content_dim, causal):
    assert_goat_backend_matches_sdpa("flash", flash32, kv, R, M, key_bias, offset, content_dim, causal)


# ---- the model: varlen document masking and ALiBi ---------------------------------------------------------
def run_both(sdpa, flash, tokens, positions, vocab):
    out = []
    for model in (sdpa, flash):
        logits = model(tokens, positions)[..., :vocab]
        torch.manual_seed(1)
        (logits * torch.randn_like(logits)).sum().backward()
        out.append(logits.detach())
    return out


@pytest.mark.parametrize("position", ["goat", "alibi", "rope", "none"])
@pytest.mark.parametrize("packed", [True, False], ids=["varlen", "dense"])
def test_model_flash_matches_sdpa(world1, flash32, position, packed):
    cfg, sdpa, flash = model_pair(position, "flash")
    torch.manual_seed(0)
    if packed:  # documents restart their positions: one continued from a previous window, two fresh
        row = torch.cat([torch.arange(7, 22), torch.arange(0, 30), torch.arange(0, 19)])
        positions = torch.stack([row, torch.arange(64)])
    else:
        positions = torch.stack([torch.arange(64), torch.arange(64) + 1000])
    tokens = torch.randint(0, cfg.vocab_size, positions.shape)
    ys, yf = run_both(sdpa, flash, tokens, positions, cfg.vocab_size)
    expected = "flash_attn_varlen_func" if packed else "flash_attn_func"
    assert set(flash32.calls) == {expected} and len(flash32.calls) == cfg.num_layers
    assert (ys - yf).abs().max().item() <= 1e-5
    assert_grads_close(sdpa, flash)


def test_alibi_flash_gets_the_slopes(world1, flash32):
    """flash computes ALiBi itself: the slopes reach the kernel (fp32, one per local query head)."""
    seen = []
    original = flash32.flash_attn_func

    def spy(*args, **kwargs):
        seen.append(kwargs.get("alibi_slopes"))
        return original(*args, **kwargs)

    flash32.flash_attn_func = spy
    with installed(flash32):
        _, _, flash = model_pair("alibi", "flash")
        flash(torch.randint(0, 300, (1, 16)), torch.arange(16)[None])
    assert len(seen) == 2 and all(
        s is not None and s.dtype == torch.float32 and s.shape == (4,) for s in seen
    )


def test_packed_documents_are_found_once_per_forward_not_per_layer(world1, flash32, monkeypatch):
    """Finding the documents syncs with the host (``kernels.cu_seqlens``); every layer of one forward reuses
    the answer, so a 2-layer forward computes it once."""
    import sys

    cfg, _, flash = model_pair("goat", "flash")
    found = []
    nonzero = torch.nonzero

    def spy(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "cu_seqlens":
            found.append(1)
        return nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", spy)
    row = torch.cat([torch.arange(7, 22), torch.arange(0, 30), torch.arange(0, 19)])
    positions = torch.stack([row, torch.arange(64)])
    flash(torch.randint(0, cfg.vocab_size, positions.shape), positions)
    assert len(flash32.calls) == cfg.num_layers == 2
    assert len(found) == 1
