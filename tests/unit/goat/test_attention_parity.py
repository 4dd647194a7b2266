"""GOAT attention against the authors' reference (PyPI ``goat-attention``) and across kernels.

The oracle is run in float64 as well as float32: at large position offsets the reference's own fp32
result carries ~4e-4 of rounding error (its recency lane ``slope * t_j`` is ~5e4 at t = 1e5, and its
Fourier phases ``w * t`` are formed in fp32), which our implementation avoids, so exactness is checked
against the oracle evaluated in float64 (its fp32-only sink MLP aside).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from goat_dist.goat import from_reference

goat = pytest.importorskip("goat.attention", reason="test dependency goat-attention is not installed")

OFFSETS = [0, 7, 1000, 100000]
CASES = [
    dict(causal=c, kv_heads=kv, R=R, M=M, init=init, key_bias=kb, offset=OFFSETS[i % len(OFFSETS)])
    for i, (c, kv, R, M, init, kb) in enumerate(
        itertools.product(
            [True, False], [4, 2], [0, 2, 4, 8], [2, 4, 8], ["seeded", "uniform"], [True, False]
        )
    )
]


def case_id(c):
    return "{}-kv{}-R{}-M{}-{}-{}-off{}".format(
        "causal" if c["causal"] else "bidir",
        c["kv_heads"],
        c["R"],
        c["M"],
        c["init"],
        "kb" if c["key_bias"] else "nokb",
        c["offset"],
    )


def make_reference(case, fuse=False, embed_dim=128, seed=0):
    torch.manual_seed(seed)
    ref = goat.GoatAttention(
        embed_dim=embed_dim,
        num_heads=4,
        kv_num_heads=case["kv_heads"],
        pos_rank=case["R"],
        abs_rank=case["M"],
        enable_key_bias=case["key_bias"],
        prior_init=case["init"],
        training_seq_len=512,
        batch_first=True,
        fuse_qkv=fuse,
    )
    if case["init"] == "uniform" and case["key_bias"]:
        # Uniform init zeroes the sink's output layer and the slope; perturb so every term is exercised.
        with torch.no_grad():
            ref.key_bias.fc2.weight.normal_(std=0.3)
            ref.recency_slope_raw.fill_(-3.0)
            ref.sink_bump.fill_(0.7)
            ref.lambda_sym.normal_(std=0.1)
            ref.lambda_asym.normal_(std=0.1)
    return ref


def in_float64(ref):
    """The oracle in float64, its Fourier features included (it forms them in fp32 by design)."""
    from goat._fourier import _fourier_features

    ref64 = copy.deepcopy(ref).to(torch.float64)
    ref64._get_rel_feats = lambda L, dtype, device, offset=0: _fourier_features(
        L, ref64.rel_freqs_base.double(), offset=offset
    ).to(dtype)
    ref64._get_abs_feats = lambda L, dtype, device, offset=0: _fourier_features(
        L, ref64.abs_freqs_base.double(), offset=offset
    ).to(dtype)
    return ref64


def run_reference(ref, x, case):
    x = x.detach().clone().requires_grad_(True)
    off = case["offset"]
    y, _ = ref(
        x, x, x, is_causal=case["causal"], need_weights=False, position_offset_q=off, position_offset_k=off
    )
    return y, x


def run_ours(mod, x, case):
    x = x.detach().clone().requires_grad_(True)
    pos = torch.arange(x.shape[1]) + case["offset"]
    return mod(x, pos, causal=case["causal"]), x


def grads_in_our_layout(ref):
    """Reference gradients mapped through ``from_reference`` itself (it maps any tensors it is given)."""
    holder = copy.deepcopy(ref)
    for p_holder, p in zip(holder.parameters(), ref.parameters()):
        p_holder.data = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return dict(from_reference(holder.float(), backend="eager").named_parameters())


# The sink MLP's output bias adds the same constant to every key's logit: softmax ignores it, so its
# exact gradient is 0 and any fp32 implementation returns rounding noise. It is checked to be noise-sized.
SHIFT_ONLY = {"prior.sink_mlp.fc2.bias"}


# Gradients of the key-only sink lane are sums over keys that nearly cancel (shift invariance again):
# eager and the folded kernel round them differently, so they agree to 1e-3 relative (the first layer's
# bias, nearly a pure shift itself, to 1e-2), not 1e-5. A folding error would show as O(1). Everything
# else is compared at 1e-5. Against the oracle the same names get these bounds instead of 1e-4: torch's
# fused CPU kernel (which ours reaches) sums its backward in blocks, the oracle's math kernel does not.
CANCELLING = {
    "prior.sink_mlp.fc1.bias": 1e-2,
    "prior.sink_mlp.fc1.weight": 1e-3,
    "prior.recency_slope_raw": 1e-3,
}


def assert_shift_only_gradient(mod, name):
    g = dict(mod.named_parameters())[name].grad
    if g is None:
        return
    scale = (
        mod.prior.sink_gain.grad.abs().max().item() + mod.prior.sink_mlp.fc2.weight.grad.abs().max().item()
    )
    assert g.abs().max().item() <= 1e-4 * max(scale, 1.0), f"{name}: {g} should be ~0"


def assert_close_rel(ours, exact, ref_fp32, name, rel=1e-4):
    """|ours - exact| <= max(rel * |exact|, 10 * |reference_fp32 - exact|, 2e-8) (Frobenius norms).

    The absolute floor is fp32's epsilon times the ~0.1 scale of the per-key terms that cancel.
    """
    ours, exact, ref_fp32 = ours.double(), exact.double(), ref_fp32.double()
    err = (ours - exact).norm().item()
    bound = max(rel * exact.norm().item(), 10 * (ref_fp32 - exact).norm().item(), 2e-8)
    assert err <= bound, f"{name}: |diff| {err:.3e} > bound {bound:.3e} (|exact| {exact.norm().item():.3e})"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference_fp32(case):
    """Outputs to 1e-5 abs; gradients to 1e-4 relative (sums over keys that cancel: see CANCELLING).

    Some prior gradients are (nearly) zero by softmax's shift invariance (the sink MLP's output bias
    moves every key's logit equally), so their fp32 value is rounding noise in any implementation; for
    those the bound is the reference's own fp32 error in the same case (x10) or an fp32 noise floor.
    """
    L = 96
    ref = make_reference(case, fuse=case["R"] % 4 == 0)
    ours = from_reference(ref, backend="sdpa")
    x = torch.randn(2, L, 128)

    ref64 = in_float64(ref)
    y64, x64 = run_reference(ref64, x.double(), case)
    y32, x32 = run_reference(ref, x, case)
    y, xg = run_ours(ours, x, case)
    assert (y.double() - y64).abs().max().item() <= 1e-5
    if case["offset"] <= 1000:  # where the reference's own fp32 rounding is small, compare fp32 to fp32
        assert (y - y32).abs().max().item() <= 1e-5

    g_out = torch.randn_like(y)
    y.backward(g_out)
    y32.backward(g_out)
    y64.backward(g_out.double())
    assert_close_rel(xg.grad, x64.grad, x32.grad, "input")
    exact, ref_fp32 = grads_in_our_layout(ref64), grads_in_our_layout(ref)
    for name, p in ours.named_parameters():
        ours_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name in SHIFT_ONLY:
            assert_shift_only_gradient(ours, name)
            continue
        rel = CANCELLING.get(name, 1e-4)
        assert_close_rel(ours_grad, exact[name].detach(), ref_fp32[name].detach(), name, rel=rel)


@pytest.mark.parametrize("L,offset,kv", [(1024, 0, 2), (1024, 100000, 4), (512, 99000, 1)])
def test_matches_reference_long(L, offset, kv):
    case = dict(causal=True, kv_heads=kv, R=4, M=4, init="seeded", key_bias=True, offset=offset)
    ref = make_reference(case)
    ours = from_reference(ref, backend="sdpa")
    x = torch.randn(2, L, 128)
    y64, _ = run_reference(in_float64(ref), x.double(), case)
    y, _ = run_ours(ours, x, case)
    # fp32 against float64: 2.7e-6 / 1.0e-5 / 1.6e-6 for these three cases on one Xeon (the exact figure
    # depends on the CPU's matmul kernels: 1.0017e-5 failed a 1e-5 limit on one machine, not another); the
    # reference's own fp32 run is off by 3.0e-6 / 1.2e-3 / 2.8e-5 (its phase w*(i-j) in fp32 at i ~ 1e5)
    assert (y.double() - y64).abs().max().item() <= 2e-5


@pytest.mark.parametrize("case", CASES[::3], ids=case_id)
def test_eager_equals_sdpa(case):
    ref = make_reference(case)
    eager = from_reference(ref, backend="eager")
    sdpa = from_reference(ref, backend="sdpa")
    x = torch.randn(2, 128, 128)
    ye, xe = run_ours(eager, x, case)
    ys, xs = run_ours(sdpa, x, case)
    assert (ye - ys).abs().max().item() <= 1e-5
    g = torch.randn_like(ye)
    ye.backward(g)
    ys.backward(g)
    assert (xe.grad - xs.grad).abs().max().item() <= 1e-5
    for (name, pe), ps in zip(eager.named_parameters(), sdpa.parameters()):
        if pe.grad is None:
            assert ps.grad is None, name
        elif name in SHIFT_ONLY:
            assert_shift_only_gradient(eager, name)
            assert_shift_only_gradient(sdpa, name)
        else:
            rel = CANCELLING.get(name, 1e-5)
            err, scale = (pe.grad - ps.grad).norm().item(), ps.grad.norm().item()
            assert err <= rel * scale + 1e-7, f"{name}: {err:.3e} vs |grad| {scale:.3e}"
