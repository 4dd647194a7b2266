"""The project's FlashAttention-4 (``flash4``) code paths, run on CPU through
``tests/harness/flash4_standin.py``.

The stand-in itself is checked in ``tests/unit/kernels/test_flash4_standin.py``. Here the project: the
head-dim plan per GPU generation, ``auto`` selection with faked device capabilities and import
availability, GOAT (causal, GQA, several R/M, q/k wider than v) and the model (GOAT, RoPE, NoPE; dense and
varlen document masking) through ``flash4`` with the stand-in in fp32 against ``sdpa`` to 1e-5, outputs
and gradients, and the log-sum-exp against explicit float64 math. On a GPU the real kernel runs in
``tests/gpu``.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from harness.backend_checks import (
    GOAT_CASES,
    assert_goat_backend_matches_sdpa,
    assert_grads_close,
    model_pair,
)
from harness.flash4_standin import Flash4Standin, fa2_cute_interface, installed
from harness.flash_standin import FlashStandin
from harness.flash_standin import installed as installed_fa2

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
@pytest.mark.parametrize("position", ["goat", "rope", "none"])
@pytest.mark.parametrize("packed", [True, False], ids=["varlen", "dense"])
def test_model_flash4_matches_sdpa(world1, fa4, position, packed):
    cfg, sdpa, flash4 = model_pair(position, "flash4")
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
    _, _, flash4 = model_pair("alibi", "flash4")
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


# ---- context parallelism with packed documents: FA4's varlen kernel per chunk ------------------------------
def _cp_document_positions(batch: int, length: int = 48) -> torch.Tensor:
    """Row 0: a document continued from an earlier window, then documents starting at 5, 17, 24 (a chunk
    boundary for cp 2 and 4) and 40; row 1 (if any): one document, far from position 0."""
    row = torch.arange(length) + 7
    for cut in (5, 17, 24, 40):
        row[cut:] = torch.arange(length - cut)
    return torch.stack([row, torch.arange(length) + 700][:batch])


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("cp,batch", [(2, 1), (4, 2)])
def test_context_parallel_documents_take_fa4_varlen_and_equal_the_masked_path(arch, cp, batch):
    """Every CP rank's chunks under packed documents go through FA4's varlen kernel (each document's
    queries against its keys up to the chunk end) with GOAT's exact prior folded into q/k (GQA, lanes
    from global positions and the whole row's origin), and give the masked SDPA path's outputs and
    gradients (content q/k, v, the prior's parameters): the stand-in in fp32 against that path in fp64
    (in fp32 the masked path itself is the less exact of the two on the prior's gradients)."""
    from goat_dist.goat import fold_prior
    from goat_dist.goat.exact import sequence_origin
    from goat_dist.parallel.context import context_attention, make_shard

    torch.manual_seed(0)
    L, H, Hk, d_c = 48, 4, 2, 16
    positions = _cp_document_positions(batch, L)
    prior = GoatPrior(Hk, 3, 4, training_seq_len=64)
    with torch.no_grad():
        for p in prior.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    inputs = [torch.randn(batch, L, h, d) for h, d in ((H, d_c), (Hk, d_c), (Hk, d_c + prior.num_lanes))]
    weights = torch.randn(batch, L, H, d_c + prior.num_lanes)
    results, standin = {}, Flash4Standin(allow_fp32=True, arch=arch)
    for backend, dtype in (("sdpa", torch.float64), ("flash4", torch.float32)):
        ours = copy.deepcopy(prior).to(dtype)
        qc, kc, v = leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
        q, k = fold_prior(qc, kc, ours, positions, causal=True, origin=sequence_origin(positions))
        outs, total = [], 0
        with installed(standin):
            for rank in range(cp):
                shard = make_shard(positions, cp, rank)
                out = context_attention(shard.split(q), k, v, shard, scale=d_c**-0.5, backend=backend)
                outs.append(out.detach().double())
                total = total + (out * shard.split(weights.to(dtype))).sum()
                if backend == "flash4":  # one row: the keys are a slice of the gathered K/V, no copy
                    assert all(isinstance(e[0], slice) == (batch == 1) for e in shard._varlen.values())
        total.backward()
        results[backend] = (outs, [t.grad.double() for t in [*leaves, *ours.parameters()]])
    assert standin.calls == ["flash_attn_varlen_func"] * (2 * cp)  # two chunks per rank, no masked SDPA
    assert any(len(lq) > batch for lq, _ in standin.varlen)  # a chunk split by document
    assert any(a < b for lq, lk in standin.varlen for a, b in zip(lq, lk))  # queries < their key prefix
    for got, want in zip(results["flash4"][0], results["sdpa"][0]):
        assert (got - want).abs().max().item() <= 1e-5
    for i, (g, g_ref) in enumerate(zip(results["flash4"][1], results["sdpa"][1])):
        # relative to the largest entry: the lanes carry values up to 256 (exact.py's query side)
        err, size = (g - g_ref).abs().max().item(), g_ref.abs().max().item()
        assert err <= 1e-5 * max(size, 1.0), f"gradient {i}: {err:.2e} vs max |grad| {size:.2e}"
