"""The project's FlashAttention-4 (``flash4``) code paths, run on CPU through ``tests/flash4_standin.py``.

First the stand-in itself is checked against attention written out explicitly in float64 (layouts,
bottom-right causal alignment, q/k and v of different head dims, natural-log LSE, varlen packing,
gradients) and against the kernel's documented rejections. Then the project: the head-dim plan per GPU
generation, ``auto`` selection with faked device capabilities and import availability, GOAT (causal,
GQA, several R/M, q/k wider than v) and the model (GOAT, RoPE, NoPE; dense and varlen document masking)
through ``flash4`` with the stand-in in fp32 against ``sdpa`` to 1e-5, outputs and gradients, and the
log-sum-exp against explicit float64 math. On a GPU the real kernel runs in ``tests/gpu``.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from flash4_standin import Flash4Standin, fa2_cute_interface, head_dims_supported, installed
from flash_standin import FlashStandin
from flash_standin import installed as installed_fa2
from test_flash_paths import GOAT_CASES, assert_goat_backend_matches_sdpa, assert_grads_close

from goat_dist.config import ModelConfig
from goat_dist.goat import GoatPrior, GoatSelfAttention
from goat_dist.kernels import (
    attend,
    document_segments,
    fa4_dims,
    flash4_head_dims,
    flash_imports,
    resolve_backend,
)
from goat_dist.kernels import backend as kernel_backend


@pytest.fixture
def fa4():
    """The stand-in, fp32 allowed (exact comparisons), playing an H100/H200 (9.0), for one test."""
    with installed(Flash4Standin(allow_fp32=True, arch=90)) as standin:
        yield standin


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
    found them, tests/fa4_compile.py)."""
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


# ---- head dims per GPU generation --------------------------------------------------------------------------
def test_flash4_head_dims_plan():
    assert flash4_head_dims(64, 64, 9) == (64, 64)
    assert flash4_head_dims(34, 32, 9) == (40, 32)  # padded to multiples of 8; v keeps its own width
    assert flash4_head_dims(60, 60, None) == (64, 64)  # unknown GPU: only the alignment
    assert flash4_head_dims(256, 248, 10) == (256, 256)  # 10.x takes 256 only with an equal v: pad v
    assert flash4_head_dims(64, 256, 10) == (64, 128)  # v wider than 10.x takes: slices of 128
    assert flash4_head_dims(200, 200, 9) == (200, 200)
    assert flash4_head_dims(64, 256, 9) == (64, 192)  # 9.x: 192-row tiles hold no wider v (registers)
    assert flash4_head_dims(128, 256, 9) == (128, 256)
    # under GQA v takes q/k's width where the backward wants it
    assert flash4_head_dims(66, 64, 9, gqa=True) == (72, 72)  # from_reference: q/k two lanes wider
    assert flash4_head_dims(66, 64, 9) == (72, 64)  # without GQA FA4 takes unequal widths
    assert flash4_head_dims(66, 64, 10, gqa=True) == (72, 64)  # 10.x: below q/k 128 it does too
    assert flash4_head_dims(128, 64, 10, gqa=True) == (128, 128)  # 2-CTA: the dV tile must fit
    assert flash4_head_dims(128, 104, 10, gqa=True) == (128, 104)
    assert flash4_head_dims(64, 256, 9, gqa=True) == (64, 64)  # a wide v in slices of q/k's width
    assert flash4_head_dims(40, 32, 10) == (40, 40)  # 10.x: a 32-wide v beside other q/k widths
    assert flash4_head_dims(66, 64, 12, gqa=True) == (72, 72)  # not compiled by the check: equal widths
    with pytest.raises(ValueError, match="head dim 130"):
        flash4_head_dims(130, 128, 10, gqa=True)
    with pytest.raises(
        ValueError, match=r"10\.x .*head dim 160.*nearest supported head_dim is 128 \(or 256\)"
    ):
        flash4_head_dims(160, 160, 10)
    with pytest.raises(ValueError, match=r"9\.x .*head dim 320.*nearest supported head_dim is 256"):
        flash4_head_dims(320, 320, 9)


# ---- auto selection with faked devices and imports ---------------------------------------------------------
def fake_imports(monkeypatch, fa4: bool, fa2: bool):
    """Which flash-attn generations import (the GPU's capability goes to ``resolve_backend``)."""
    monkeypatch.setattr(flash_imports, "_flash_attn_cute", lambda: object() if fa4 else None)
    monkeypatch.setattr(flash_imports, "_flash_attn", lambda: object() if fa2 else None)


AUTO_CASES = [
    # capability, flash-attn-4 imports, flash-attn 2 imports, position, head_dim -> auto's choice
    (None, True, True, None, None, "sdpa"),  # no CUDA
    ((7, 5), True, True, None, None, "sdpa"),  # Turing: neither flash-attn generation
    ((8, 0), True, True, None, None, "flash"),  # A100: FA4 has no backward on 8.x
    ((8, 6), True, False, None, None, "sdpa"),
    ((8, 9), False, True, None, None, "flash"),  # Ada
    ((9, 0), True, True, None, None, "flash4"),  # H100 / H200
    ((9, 0), False, True, None, None, "flash"),
    ((9, 0), False, False, None, None, "sdpa"),
    ((10, 0), True, False, None, None, "flash4"),  # B200
    ((10, 3), True, True, "goat", 64, "flash4"),  # B300
    ((12, 0), True, True, None, None, "flash4"),  # RTX PRO / RTX 50
    ((13, 0), True, True, None, None, "flash"),  # a generation FA4 does not know
    ((9, 0), True, True, "alibi", 64, "flash"),  # FA4 ships no ALiBi: FA2 computes it
    ((9, 0), True, False, "alibi", 64, "sdpa"),
    ((10, 0), True, True, "rope", 160, "flash"),  # head dim 160 is not a 10.x FA4 kernel
    ((9, 0), True, False, "rope", 160, "flash4"),  # but is one on 9.x
    ((9, 0), True, False, "rope", 320, "sdpa"),
]


@pytest.mark.parametrize("capability,fa4,fa2,position,head_dim,expected", AUTO_CASES)
def test_auto_picks_the_fastest_kernel_that_imports_and_fits(
    monkeypatch, capability, fa4, fa2, position, head_dim, expected
):
    fake_imports(monkeypatch, fa4, fa2)
    auto = resolve_backend("auto", position=position, head_dim=head_dim, capability=capability)
    assert auto == expected
    for name in ("sdpa", "eager"):
        assert resolve_backend(name, capability=capability) == name


@pytest.mark.parametrize(
    "capability,fa4,kwargs,error,pattern",
    [
        (None, True, {}, RuntimeError, "flash4 was requested but CUDA is not available"),
        ((8, 0), True, {}, RuntimeError, r"compute capability 8\.0 .*9\.x-12\.x.*attention_backend=flash"),
        ((9, 0), False, {}, RuntimeError, r"flash_attn\.cute \(PyPI flash-attn-4\) does not import.*\[gpu\]"),
        ((9, 0), True, {"position": "alibi"}, ValueError, "alibi does not run on .*flash4.*score_mod"),
        ((10, 0), True, {"head_dim": 160}, ValueError, "nearest supported head_dim is 128"),
    ],
)  # fmt: skip
def test_explicit_flash4_says_why_not(monkeypatch, capability, fa4, kwargs, error, pattern):
    fake_imports(monkeypatch, fa4, fa2=True)
    with pytest.raises(error, match=pattern):
        resolve_backend("flash4", capability=capability, **kwargs)


def test_flash_still_means_flash_attn_2(monkeypatch):
    fake_imports(monkeypatch, fa4=True, fa2=False)
    with pytest.raises(RuntimeError, match=r"flash-attn does not import.*goat-dist\[flash2\]"):
        resolve_backend("flash", capability=(9, 0))
    with pytest.raises(RuntimeError, match=r"flash was requested but CUDA is not available"):
        resolve_backend("flash", capability=None)
    monkeypatch.undo()
    with installed_fa2(FlashStandin()):
        assert resolve_backend("flash") == "flash"


# ---- GOAT through the flash4 path --------------------------------------------------------------------------
@pytest.mark.parametrize("kv,R,M,key_bias,offset,content_dim", GOAT_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_goat_flash4_matches_sdpa(fa4, kv, R, M, key_bias, offset, content_dim, causal):
    assert_goat_backend_matches_sdpa("flash4", fa4, kv, R, M, key_bias, offset, content_dim, causal)


def test_v_wider_than_the_kernel_takes_runs_in_slices():
    """On 10.x FA4 takes v head dims up to 128 with q/k of 64: a 256-wide v (the attention diagnostics'
    one-hot keys) goes in two calls and gives sdpa's result."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 24, 4, 60), torch.randn(2, 24, 2, 60)
    v = torch.randn(2, 24, 2, 250, requires_grad=True)
    segments = torch.tensor([[1] * 10 + [2] * 14, [1] * 24])
    with installed(Flash4Standin(allow_fp32=True, arch=100)) as standin:
        out = attend(q, k, v, causal=True, scale=0.125, backend="flash4", segments=segments)
    ref = attend(q, k, v, causal=True, scale=0.125, backend="sdpa", segments=segments)
    assert standin.calls == ["flash_attn_varlen_func"] * 2 and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5
    (g,) = torch.autograd.grad(out.sum(), v)
    (g_ref,) = torch.autograd.grad(ref.sum(), v)
    assert (g - g_ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("kind", ["from_reference", "wide_content"])
def test_gqa_module_with_wider_qk_pads_v_for_the_backward(monkeypatch, arch, kind):
    """GoatSelfAttention under GQA with q/k wider than v (``from_reference``'s content dims, or
    ``content_dim`` giving q/k 128 over v 64): the real backward refuses unequal widths there (9.x
    always, 10.x at (128, 64)); the project pads v to the q/k width, the output and all gradients equal
    sdpa's, and the kernel gets v as wide as q/k. Without the padding the backward raises."""
    torch.manual_seed(0)
    if kind == "from_reference":  # D = 32, R = 4: content 23 (the reference's D - 2R - 1), q/k 34 -> 40
        sdpa = GoatSelfAttention(128, 4, 2, pos_rank=4, content_dim=23, backend="sdpa")
    else:  # D = 64, R = 4: content 117 + 11 lanes = q/k 128
        sdpa = GoatSelfAttention(256, 4, 2, pos_rank=4, content_dim=117, backend="sdpa")
    x = torch.randn(2, 24, sdpa.embed_dim)
    widths, standin = [], Flash4Standin(allow_fp32=True, arch=arch)
    original = standin.flash_attn_func

    def spy(q, k, v, **kwargs):
        widths.append((q.shape[-1], v.shape[-1]))
        return original(q, k, v, **kwargs)

    standin.flash_attn_func = spy
    with installed(standin):
        sdpa_out, ours = sdpa(x), copy.deepcopy(sdpa)
        ours.backend = "flash4"
        out = ours(x)
        assert (out - sdpa_out).abs().max().item() <= 1e-5
        g = torch.randn_like(out)
        out.backward(g)
        sdpa_out.backward(g)
        assert_grads_close(sdpa, ours)
        assert widths and all(wq == wv for wq, wv in widths), widths
        # the code before the fix: v at its own width under GQA
        plan = fa4_dims.flash4_head_dims
        monkeypatch.setattr(
            fa4_dims, "flash4_head_dims", lambda dq, dv, major, gqa=False: plan(dq, dv, major)
        )
        message = "GQA backward requires head_dim" if arch == 90 else "sdV doesn't fit"
        if arch == 100 and kind == "from_reference":
            ours(x).sum().backward()  # q/k below 128 on 10.x: the unequal backward exists
        else:
            with pytest.raises(AssertionError, match=message):
                ours(x).sum().backward()


# ---- the co-installed FlashAttention-2 and what auto says ------------------------------------------------
@pytest.fixture
def fa2_cute(monkeypatch):
    """``flash_attn.cute.interface`` as the FlashAttention-2 sdist leaves it, on a faked H100."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fa2_cute_interface())
    monkeypatch.setattr(flash_imports, "_NOTICE_GIVEN", [])
    flash_imports._flash_attn_cute.cache_clear()
    yield (9, 0)
    flash_imports._flash_attn_cute.cache_clear()


def test_fa2s_flash_attn_cute_is_named_with_the_fix(fa2_cute, capsys):
    """An import that succeeds but lacks FA4's API (no return_lse): not used, and every message says
    what happened and how to repair the environment."""
    h100 = fa2_cute
    assert flash_imports._flash_attn_cute() is None
    expected = (r"flash4 was requested but .*takes no return_lse.*FlashAttention-2 sdist.*both packages"
                r".*pip uninstall -y flash-attn flash-attn-4")  # fmt: skip
    with pytest.raises(RuntimeError, match=expected):
        resolve_backend("flash4", capability=h100)
    assert (
        resolve_backend("auto", capability=h100) == "sdpa"
        and resolve_backend("auto", capability=h100) == "sdpa"
    )
    err = capsys.readouterr().err
    assert err.count("attention_backend=auto takes sdpa, not flash4") == 1  # said once
    assert "takes no return_lse" in err and "separate environments" in err


def test_auto_says_once_why_flash4_did_not_import(monkeypatch, capsys):
    """On a GPU where FA4 would serve, an import error (e.g. no triton) is said once, with its text."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # import raises ImportError
    monkeypatch.setattr(flash_imports, "_NOTICE_GIVEN", [])
    monkeypatch.setattr(flash_imports, "both_installed", lambda: False)
    flash_imports._flash_attn_cute.cache_clear()
    h100 = (9, 0)
    try:
        assert resolve_backend("auto", capability=h100) == "sdpa"
        assert resolve_backend("auto", position="goat", capability=h100) == "sdpa"
    finally:
        flash_imports._flash_attn_cute.cache_clear()
    err = capsys.readouterr().err
    assert err.count("not flash4: flash_attn.cute (PyPI flash-attn-4) does not import (ModuleNotFound") == 1
    monkeypatch.setattr(flash_imports, "_NOTICE_GIVEN", [])
    assert (
        resolve_backend("auto", capability=(8, 0)) == "sdpa"
    )  # an A100: FA4 would not serve there, nothing to say
    assert capsys.readouterr().err == ""


def test_import_failure_names_the_coinstall(monkeypatch):
    monkeypatch.setattr(flash_imports, "both_installed", lambda: True)
    text = flash_imports.import_failure(ImportError("cannot import name 'X'"))
    assert "does not import (ImportError: cannot import name 'X')" in text
    assert "both installed" in text and "pip uninstall -y flash-attn flash-attn-4" in text


# ---- the log-sum-exp (context parallelism merges partial results with it) ---------------------------------
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_goat_lse_matches_explicit_math(fa4, packed):
    """flash4's (out, lse) for GOAT's folded q/k equal float64 math on the explicit log-prior, and their
    gradients equal those of the eager backend (explicit fp32 logits), to 1e-5."""
    torch.manual_seed(0)
    B, L, H, Hk, d_c = 2, 32, 4, 2, 16
    prior = GoatPrior(Hk, 3, 4)
    with torch.no_grad():
        for p in prior.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    if packed:
        row = torch.cat([torch.arange(5, 17), torch.arange(0, 20)])
        positions = torch.stack([row, torch.arange(L) + 300])
    else:
        positions = torch.stack([torch.arange(L), torch.arange(L) + 1000])
    segments = document_segments(positions)
    assert (segments is not None) == packed
    qc, kc = torch.randn(B, L, H, d_c), torch.randn(B, L, Hk, d_c)
    v = torch.randn(B, L, Hk, d_c + prior.num_lanes)
    scale = d_c**-0.5
    q_lanes, k_lanes = prior.lanes(positions, True, scale=scale)
    q = torch.cat([qc, q_lanes.repeat_interleave(H // Hk, dim=2)], -1).detach()
    k = torch.cat([kc, k_lanes], -1).detach()

    # float64 on the explicit prior: logits = scale * q_c.k_c + K_ij, masked to the documents, causal
    with torch.no_grad():
        K = prior.log_prior(positions, True).double().repeat_interleave(H // Hk, dim=1)
    logits = torch.einsum("bihd,bjhd->bhij", qc.double(), kc.double().repeat_interleave(H // Hk, 2))
    logits = logits * scale + K
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    if packed:
        keep = keep & (segments[:, None, :, None] == segments[:, None, None, :])
    ref_lse = torch.logsumexp(logits.masked_fill(~keep, -math.inf), -1)
    ref_out = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits.masked_fill(~keep, -math.inf), -1),
                           v.double().repeat_interleave(H // Hk, 2))  # fmt: skip

    def folded64(q, k, v):  # float64 on the folded q/k the kernel gets: the gradients' reference
        g = H // Hk
        logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(g, 2)) * scale
        logits = logits.masked_fill(~keep, -math.inf)
        out = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits, -1), v.repeat_interleave(g, 2))
        return out, torch.logsumexp(logits, -1)

    torch.manual_seed(1)
    g_out, g_lse = torch.randn(B, L, H, v.shape[-1]), torch.randn(B, H, L)
    results = {}
    for backend in ("flash4", "float64"):
        dtype = torch.float64 if backend == "float64" else torch.float32
        leaves = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        if backend == "float64":
            out, lse = folded64(*leaves)
        else:
            out, lse = attend(
                *leaves, causal=True, scale=scale, backend=backend, segments=segments, return_lse=True
            )
        ((out * g_out.to(dtype)).sum() + (lse * g_lse.to(dtype)).sum()).backward()
        results[backend] = (out, lse, [t.grad for t in leaves])
    out, lse, grads = results["flash4"]
    assert fa4.calls == ["flash_attn_varlen_func" if packed else "flash_attn_func"]
    assert lse.shape == (B, H, L) and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    assert (out.double() - ref_out).abs().max().item() <= 1e-5
    assert (results["float64"][1] - ref_lse).abs().max().item() <= 1e-5  # lanes == explicit prior
    for name, g, g_ref in zip("qkv", grads, results["float64"][2]):
        # relative to the largest entry: the lanes carry values up to 256 (exact.py's query side)
        err, size = (g.double() - g_ref).abs().max().item(), g_ref.abs().max().item()
        assert err <= 1e-5 * size, f"d{name}: {err:.2e} vs max |grad| {size:.2e}"
    eager_out, eager_lse = attend(
        q, k, v, causal=True, scale=scale, backend="eager", segments=segments, return_lse=True
    )
    assert (eager_lse - lse).abs().max().item() <= 1e-5 and (eager_out - out).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="log-sum-exp comes from attention backends flash4 and eager"):
        attend(q, k, v, causal=True, scale=scale, backend="sdpa", return_lse=True)


# ---- the model: dense and varlen, GOAT / RoPE / NoPE; ALiBi's clear error --------------------------------
def model_pair(position: str):
    from goat_dist.model import GPT

    cfg = ModelConfig(
        vocab_size=300,
        seq_len=64,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        position=position,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    sdpa, flash4 = GPT(cfg), GPT(cfg)  # (megatron layers hold process groups: no deepcopy)
    flash4.load_state_dict(sdpa.state_dict())
    for module in flash4.modules():
        if hasattr(module, "backend"):
            module.backend = "flash4"
    return cfg, sdpa, flash4


@pytest.mark.parametrize("position", ["goat", "rope", "none"])
@pytest.mark.parametrize("packed", [True, False], ids=["varlen", "dense"])
def test_model_flash4_matches_sdpa(world1, fa4, position, packed):
    cfg, sdpa, flash4 = model_pair(position)
    torch.manual_seed(0)
    if packed:  # documents restart their positions: one continued from a previous window, two fresh
        row = torch.cat([torch.arange(7, 22), torch.arange(0, 30), torch.arange(0, 19)])
        positions = torch.stack([row, torch.arange(64)])
    else:
        positions = torch.stack([torch.arange(64), torch.arange(64) + 1000])
    tokens = torch.randint(0, cfg.vocab_size, positions.shape)
    logits = []
    for model in (sdpa, flash4):
        out = model(tokens, positions)[..., : cfg.vocab_size]
        torch.manual_seed(1)
        (out * torch.randn_like(out)).sum().backward()
        logits.append(out.detach())
    expected = "flash_attn_varlen_func" if packed else "flash_attn_func"
    assert fa4.calls == [expected] * cfg.num_layers
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5
    assert_grads_close(sdpa, flash4)


def test_model_alibi_on_flash4_is_a_clear_error(world1, fa4):
    _, _, flash4 = model_pair("alibi")
    with pytest.raises(ValueError, match="position=alibi does not run on model.attention_backend=flash4"):
        flash4(torch.randint(0, 300, (1, 16)), torch.arange(16)[None])
    assert fa4.calls == []


@pytest.mark.parametrize("position,expected", [("alibi", "flash"), ("goat", "flash4"), ("rope", "flash4")])
def test_model_auto_passes_over_flash4_for_what_it_cannot_run(world1, monkeypatch, position, expected):
    """The model hands its position scheme and head size to ``auto``: an ALiBi model on a Hopper GPU with
    both kernels installed gets FlashAttention-2, not a FlashAttention-4 that would fail at its first step."""
    from goat_dist.model import GPT

    fake_imports(monkeypatch, fa4=True, fa2=True)
    # the model resolves its backend at construction, on the device it runs on: that device plays an H100
    monkeypatch.setattr(kernel_backend, "device_capability", lambda device=None: (9, 0))
    shape = dict(vocab_size=300, seq_len=16, num_layers=1, hidden_size=64, num_heads=2)
    cfg = ModelConfig(**shape, position=position)
    assert GPT(cfg).blocks[0].attn.backend == expected
    assert GoatSelfAttention(64, 2, pos_rank=2).backend == "flash4"
