"""The FlashAttention-4 stand-in (``tests/harness/flash4_standin.py``) checked against attention written out
explicitly in float64 (layouts, bottom-right causal alignment, q/k and v of different head dims,
natural-log LSE, varlen packing, gradients) and against the real kernel's documented rejections, so that
the project's ``flash4`` paths tested through it (``tests/unit/kernels/test_flash4_paths.py``) are held to
the real kernel's rules."""

from __future__ import annotations

import math

import pytest
import torch
from harness.flash4_standin import Flash4Standin, head_dims_supported, installed

from goat_dist.kernels import (
    flash_imports,
    resolve_backend,
)


def explicit(q, k, v, scale, causal):
    """Float64 attention for one sequence, q (Lq, H, D), k (Lk, H_kv, D), v (Lk, H_kv, Dv): out, lse."""
    Lq, H, _ = q.shape
    Lk, Hk, _ = k.shape
    k, v = k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
    logits = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    if causal:  # bottom-right alignment: query i sees keys j <= i + Lk - Lq
        i = torch.arange(Lq)[:, None] + (Lk - Lq)
        logits = logits.masked_fill(torch.arange(Lk)[None, :] > i, -math.inf)
    lse = torch.logsumexp(logits, -1)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]))  # a row that sees nothing -> zeros
    return torch.einsum("hij,jhd->ihd", probs, v), lse


# ---- the stand-in against explicit attention -----------------------------------------------------------
@pytest.mark.parametrize("Lq,Lk", [(7, 7), (3, 6), (6, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_standin_func_matches_explicit(Lq, Lk, causal):
    torch.manual_seed(0)
    standin = Flash4Standin(allow_fp32=True)
    B, H, Hk, D, Dv = 2, 4, 2, 16, 8  # FA4 takes a v head dim different from q/k's
    q, k, v = torch.randn(B, Lq, H, D), torch.randn(B, Lk, Hk, D), torch.randn(B, Lk, Hk, Dv)
    out, lse = standin.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True)
    assert out.shape == (B, Lq, H, Dv) and lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    for b in range(B):
        ref_out, ref_lse = explicit(q[b], k[b], v[b], 0.3, causal)
        assert (out[b].double() - ref_out).abs().max() <= 1e-5
        seen = torch.isfinite(ref_lse)
        assert (lse[b][seen].double() - ref_lse[seen]).abs().max() <= 1e-5
        assert (lse[b][~seen] == -math.inf).all() and not out[b][(~seen).all(0)].any()  # FA4: -inf
    assert standin.flash_attn_func(q, k, v, causal=causal)[1] is None  # no lse unless asked or training
    default, _ = standin.flash_attn_func(q, k, v, causal=causal)  # default scale 1/sqrt(D)
    assert (default[0].double() - explicit(q[0], k[0], v[0], D**-0.5, causal)[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_standin_varlen_matches_explicit(causal):
    torch.manual_seed(0)
    standin = Flash4Standin(allow_fp32=True)
    H, Hk, D = 4, 1, 8
    len_q, len_k = [3, 6, 1], [5, 6, 4]
    q = torch.randn(sum(len_q), H, D)
    k, v = torch.randn(sum(len_k), Hk, D), torch.randn(sum(len_k), Hk, 16)
    cu_q = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11, 15], dtype=torch.int32)
    out, lse = standin.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=6, causal=causal,
        return_lse=True,
    )  # fmt: skip
    assert out.shape == (10, H, 16) and lse.shape == (H, 10)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse = explicit(q[sq], k[sk], v[sk], D**-0.5, causal)
        assert (out[sq].double() - ref_out).abs().max() <= 1e-5
        assert (lse[:, sq].double() - ref_lse).abs().max() <= 1e-5


def test_standin_gradients_of_out_and_lse_match_explicit():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 1, 8), torch.randn(1, 9, 1, 16)
    go, gl = torch.randn(1, 9, 2, 16), torch.randn(1, 2, 9)
    grads = []
    for run in ("standin", "explicit"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if run == "standin":  # GQA with v wider than q/k: a backward 10.x has below q/k 128, 9.x has not
            standin = Flash4Standin(allow_fp32=True, arch=100)
            out, lse = standin.flash_attn_func(*leaves, causal=True)  # lse: training
        else:
            out, lse = explicit(*(t[0] for t in leaves), 8**-0.5, True)
            out, lse = out[None], lse[None]
        ((out * go).sum() + (lse * gl).sum()).backward()
        grads.append([t.grad.double() for t in leaves])
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-5


def test_standin_low_precision_follows_the_kernel_contract():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 32) for _ in range(3))
    exact, _ = Flash4Standin(allow_fp32=True).flash_attn_func(q, k, v, causal=True)
    low, _ = Flash4Standin().flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert low.dtype == torch.bfloat16
    assert 0 < (low.float() - exact).abs().max() <= 3e-2


def test_standin_rejects_what_the_kernel_rejects():
    strict = Flash4Standin()
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    sm100 = Flash4Standin(arch=100)

    def bf16(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    cases = {
        "fp32 without the switch": lambda: strict.flash_attn_func(q.float(), q.float(), q.float()),
        "fp64 even with it": lambda: Flash4Standin(allow_fp32=True).flash_attn_func(
            q.double(), q.double(), q.double()
        ),
        "mixed dtypes": lambda: strict.flash_attn_func(q, q.half(), q),
        "H not a multiple of H_kv": lambda: strict.flash_attn_func(bf16(1, 8, 3, 16), q, q),
        "head dim not a multiple of 8": lambda: strict.flash_attn_func(*(bf16(1, 4, 1, 20),) * 3),
        "head dim 264 on SM90": lambda: strict.flash_attn_func(*(bf16(1, 4, 1, 264),) * 3),
        "head dim 160 on SM100": lambda: sm100.flash_attn_func(*(bf16(1, 4, 1, 160),) * 3),
        "v dim 256 with q/k 64 on SM100": lambda: sm100.flash_attn_func(
            bf16(1, 4, 1, 64), bf16(1, 4, 1, 64), bf16(1, 4, 1, 256)
        ),
        "k head dim differs from q": lambda: strict.flash_attn_func(q, bf16(1, 8, 2, 24), q),
        "int64 cu_seqlens": lambda: strict.flash_attn_varlen_func(
            q[0], q[0], q[0], cu_seqlens_q=cu.long(), cu_seqlens_k=cu.long()
        ),
        "max_seqlen too small": lambda: strict.flash_attn_varlen_func(
            q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4
        ),
    }
    for name, call in cases.items():
        with pytest.raises(AssertionError):
            call()
            pytest.fail(f"accepted: {name}")
    for name, call in {
        "cu_seqlens given positionally (the 4th argument is qv)": lambda: strict.flash_attn_varlen_func(
            q[0], q[0], q[0], cu, cu
        ),
        "softcap": lambda: strict.flash_attn_func(q, q, q, softcap=30.0),
        "sliding window": lambda: strict.flash_attn_func(q, q, q, window_size=(64, 0)),
    }.items():
        with pytest.raises(NotImplementedError):
            call()
            pytest.fail(f"accepted: {name}")
    assert head_dims_supported(256, 256, 100) and head_dims_supported(192, 128, 100)
    assert head_dims_supported(128, 256, 90) and not head_dims_supported(64, 256, 100)
    assert head_dims_supported(64, 192, 90) and not head_dims_supported(64, 256, 90)  # registers


@pytest.mark.parametrize(
    "arch,dq,dv,heads,kv,message",
    [
        (90, 72, 64, 4, 2, "GQA backward requires head_dim == head_dim_v"),  # flash_bwd_sm90.py
        (100, 128, 64, 4, 2, "sdV doesn't fit in sV storage allocation"),  # flash_bwd_sm100.py, 2-CTA
        (100, 64, 32, 2, 2, "valid division"),  # flash_bwd_sm100.py, without GQA too
        (90, 72, 64, 2, 2, None),  # MHA with unequal dims: both backwards take it
        (100, 72, 64, 4, 2, None),  # GQA below q/k 128 on 10.x
        (100, 128, 104, 4, 2, None),  # the dV tile fits
        (100, 72, 32, 2, 2, None),
    ],
)
def test_standin_backward_refuses_what_the_real_backward_refuses(arch, dq, dv, heads, kv, message):
    """The forward runs; the first backward raises the kernel's own message (as the compile check
    found them, tests/harness/fa4_compile.py)."""
    standin = Flash4Standin(allow_fp32=True, arch=arch)
    q = torch.randn(1, 8, heads, dq, requires_grad=True)
    k, v = torch.randn(1, 8, kv, dq), torch.randn(1, 8, kv, dv)
    out, _ = standin.flash_attn_func(q, k, v, causal=True)
    if message is None:
        out.sum().backward()
        assert q.grad is not None
    else:
        with pytest.raises(AssertionError, match=message):
            out.sum().backward()
    with torch.no_grad():  # inference never runs the backward kernel
        standin.flash_attn_func(q, k, v, causal=True)


def test_installed_standin_is_what_the_project_imports():
    before = flash_imports._flash_attn_cute()
    with installed(Flash4Standin()) as standin:
        assert flash_imports._flash_attn_cute().flash_attn_func == standin.flash_attn_func
        assert resolve_backend("flash4") == "flash4" and resolve_backend("auto") == "flash4"
    assert flash_imports._flash_attn_cute() is before  # uninstalled: the real import (None on CPU machines)
