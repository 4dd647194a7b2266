"""The FlashAttention stand-ins (``goat_dist/kernels/flash4_standin.py``, ``flash_standin.py``) on the meta
device, as ``goat-dist plan --rehearse`` runs them: the rules that need no data still refuse, with
``KernelRefusal``; accepted calls give outputs of the documented shapes that a backward runs through; and
``installed`` makes ``auto`` pick the kernel of the GPU played."""

from __future__ import annotations

import pickle

import pytest
import torch

from goat_dist.kernels import flash4_standin, flash_imports, flash_standin, resolve_backend
from goat_dist.kernels.flash4_standin import Flash4Standin
from goat_dist.kernels.flash_standin import FlashStandin
from goat_dist.kernels.refusal import KernelRefusal


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def cu_seqlens(batch: int, dtype=torch.int32):
    """Cumulative lengths on meta: a shape and a dtype, no values."""
    return torch.empty(batch + 1, dtype=dtype, device="meta")


# ---- FlashAttention-4 ------------------------------------------------------------------------------------
def test_flash4_dense_call_on_meta_has_the_documented_shapes_and_a_backward():
    q, k, v = meta(2, 16, 8, 64, grad=True), meta(2, 16, 2, 64, grad=True), meta(2, 16, 2, 48, grad=True)
    out, lse = Flash4Standin(arch=100).flash_attn_func(q, k, v, causal=True)
    assert out.is_meta and out.shape == (2, 16, 8, 48) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 16) and lse.dtype == torch.float32  # returned: inputs require grad
    (out.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.is_meta


def test_flash4_varlen_call_on_meta_has_the_documented_shapes_and_a_backward():
    standin = Flash4Standin()
    q, k, v = meta(24, 8, 128, grad=True), meta(40, 2, 128, grad=True), meta(40, 2, 128, grad=True)
    out, lse = standin.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_seqlens(3), cu_seqlens_k=cu_seqlens(3), max_seqlen_q=8, max_seqlen_k=16,
        causal=True, return_lse=True,
    )  # fmt: skip
    assert out.shape == (24, 8, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (8, 24) and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    assert standin.calls == ["flash_attn_varlen_func"] and standin.varlen == []  # no lengths on meta


def test_flash4_refuses_on_meta_what_the_kernel_refuses():
    standin = Flash4Standin()  # an H100/H200, 16-bit only
    q = meta(1, 8, 4, 64)
    with pytest.raises(KernelRefusal, match=r"FlashAttention-4 flash_attn_func \(SM90\).*float32") as fp32:
        standin.flash_attn_func(q.float(), q.float(), q.float(), causal=True)
    assert fp32.value.rule == "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
    with pytest.raises(KernelRefusal, match="must have the same dtype"):
        standin.flash_attn_func(q, q.half(), q)
    with pytest.raises(KernelRefusal, match="num_head must be divisible by num_head_kv"):
        standin.flash_attn_func(meta(1, 8, 3, 64), q, q)
    with pytest.raises(
        KernelRefusal, match=r"\(head_dim, head_dim_v\)=\(264, 264\) is not supported on SM90"
    ):
        standin.flash_attn_func(*(meta(1, 8, 4, 264),) * 3)
    with pytest.raises(KernelRefusal, match=r"\(160, 160\) is not supported on SM100"):
        Flash4Standin(arch=100).flash_attn_func(*(meta(1, 8, 4, 160),) * 3)  # fine on SM90
    packed = meta(8, 4, 64)

    def varlen(cu_q, cu_k):
        standin.flash_attn_varlen_func(packed, packed, packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    with pytest.raises(KernelRefusal, match="must be int32.*cu_seqlens_q torch.int64"):
        varlen(cu_seqlens(2, torch.int64), cu_seqlens(2))
    with pytest.raises(KernelRefusal, match="must be contiguous"):
        varlen(cu_seqlens(2), torch.empty(6, dtype=torch.int32, device="meta")[::2])
    with pytest.raises(KernelRefusal, match=r"cu_seqlens_k must have shape \(batch_size \+ 1,\)"):
        varlen(cu_seqlens(2), cu_seqlens(3))
    with pytest.raises(NotImplementedError):  # a feature the stand-in lacks is no refusal
        standin.flash_attn_func(q, q, q, softcap=30.0)


def test_flash4_backward_rule_fires_at_the_backward_on_meta():
    q = meta(1, 8, 4, 72, grad=True)
    out, _ = Flash4Standin().flash_attn_func(q, meta(1, 8, 2, 72), meta(1, 8, 2, 64), causal=True)
    with pytest.raises(KernelRefusal, match="GQA backward requires head_dim == head_dim_v") as refusal:
        out.float().sum().backward()
    assert "backward of flash_attn_func (SM90)" in refusal.value.kernel


def test_a_refusal_is_what_the_real_kernels_raise_and_survives_pickling():
    refusal = KernelRefusal("FlashAttention-4 flash_attn_func (SM90)", "a rule", "q torch.float32")
    assert isinstance(refusal, AssertionError) and isinstance(refusal, RuntimeError)  # FA4's, FA2's
    copy = pickle.loads(pickle.dumps(refusal))
    assert (copy.kernel, copy.rule, copy.got, str(copy)) == (
        refusal.kernel, refusal.rule, refusal.got, str(refusal)
    )  # fmt: skip


# ---- flash-attn 2 ----------------------------------------------------------------------------------------
def test_flash2_calls_on_meta_have_the_documented_shapes_and_a_backward():
    standin = FlashStandin()
    q, k, v = meta(2, 16, 8, 64, grad=True), meta(2, 16, 2, 64, grad=True), meta(2, 16, 2, 64, grad=True)
    out = standin.flash_attn_func(q, k, v, causal=True)
    assert out.is_meta and out.shape == (2, 16, 8, 64) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    packed = [t.detach().flatten(0, 1).requires_grad_(True) for t in (q, k, v)]
    out, lse, probs = standin.flash_attn_varlen_func(
        *packed, cu_seqlens(4), cu_seqlens(4), 12, 12, causal=True, return_attn_probs=True
    )
    assert out.shape == (32, 8, 64) and lse.shape == (8, 32) and probs.shape == (4, 8, 12, 12)
    out.float().sum().backward()
    assert packed[2].grad.shape == packed[2].shape


def test_flash2_refuses_on_meta_what_the_kernel_refuses():
    standin = FlashStandin()
    q = meta(1, 8, 4, 64)
    with pytest.raises(KernelRefusal, match=r"flash-attn 2 flash_attn_func.*fp16 and bf16.*float32"):
        standin.flash_attn_func(q.float(), q.float(), q.float())
    with pytest.raises(KernelRefusal, match="head dimension at most 256"):
        standin.flash_attn_func(*(meta(1, 8, 4, 264),) * 3)
    with pytest.raises(KernelRefusal, match="same head dimension"):
        standin.flash_attn_func(q, q, meta(1, 8, 4, 32))
    with pytest.raises(KernelRefusal, match="must divide number of heads"):
        standin.flash_attn_func(meta(1, 8, 3, 64), q, q)
    fused = meta(1, 8, 4, 64 + 2)[..., 2:]  # 4 bytes into each row: not loadable 16 bytes at a time
    with pytest.raises(KernelRefusal, match="misaligned address"):
        standin.flash_attn_func(q, q, fused)
    packed = meta(8, 4, 64)
    with pytest.raises(KernelRefusal, match="cu_seqlens_q must have dtype int32"):
        standin.flash_attn_varlen_func(
            packed, packed, packed, cu_seqlens(2, torch.int64), cu_seqlens(2), 4, 4
        )
    with pytest.raises(KernelRefusal, match="cu_seqlens_k must be a contiguous 1-D tensor"):
        odd = torch.empty(6, dtype=torch.int32, device="meta")[::2]
        standin.flash_attn_varlen_func(packed, packed, packed, cu_seqlens(2), odd, 4, 4)
    with pytest.raises(KernelRefusal, match="the same length"):
        standin.flash_attn_varlen_func(packed, packed, packed, cu_seqlens(2), cu_seqlens(3), 4, 4)


# ---- installed: the GPU played picks the kernel ----------------------------------------------------------
def test_installed_flash4_is_picked_on_an_h100_and_restored():
    before = flash_imports._flash_attn_cute()
    with flash4_standin.installed(arch=90) as standin:
        assert resolve_backend("auto", capability=(9, 0)) == "flash4" and resolve_backend("auto") == "flash4"
        assert flash_imports._flash_attn_cute().flash_attn_func == standin.flash_attn_func
        assert not standin.allow_fp32 and standin.arch == 90
    assert flash_imports._flash_attn_cute() is before
    with pytest.raises(ValueError, match="give one of them"):
        with flash4_standin.installed(Flash4Standin(arch=100), arch=90):
            pass


def test_installed_flash2_is_picked_on_an_a100_and_restored():
    before = flash_imports._flash_attn()
    with flash_standin.installed() as standin:
        assert resolve_backend("auto", capability=(8, 0)) == "flash" and resolve_backend("auto") == "flash"
        assert flash_imports._flash_attn().flash_attn_func == standin.flash_attn_func
    assert flash_imports._flash_attn() is before


def test_the_model_path_reaches_the_installed_standin_on_meta():
    """``flash4_attention`` (what the model calls) on meta tensors goes to the stand-in and refuses
    fp32 as the real kernel would."""
    from goat_dist.kernels import flash4_attention

    q = meta(1, 8, 4, 64, grad=True)
    with flash4_standin.installed() as standin:
        out = flash4_attention(q, q, q, causal=True, scale=0.125)
        assert out.shape == (1, 8, 4, 64) and standin.calls == ["flash_attn_func"]
        with pytest.raises(KernelRefusal, match="float32"):
            flash4_attention(q.float(), q.float(), q.float(), causal=True, scale=0.125)
