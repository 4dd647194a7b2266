"""FlashAttention-4's interface, recording and compiling instead of running
(``tests/harness/fa4_compile.py``): each ``flash_attn_func`` / ``flash_attn_varlen_func`` call the project
makes is replayed on fake CUDA tensors of the same shapes and strides through FA4's ``_flash_attn_fwd``
and, for inputs that require grad, ``_flash_attn_bwd``, which compiles the real kernels (and runs their
checks) without a GPU."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path


# ---- the recording, compiling interface ------------------------------------------------------------------
def _fake_like(t, fake_mode):
    """A fake CUDA tensor with ``t``'s dtype, shape, strides and storage offset. It never requires grad:
    CPU torch's autograd fails on fake CUDA tensors; for FA4 ``requires_grad`` only decides that the
    forward writes the log-sum-exp, which ``return_lse`` asks for here."""
    import torch

    if t is None:
        return None
    with fake_mode:
        span = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        base = torch.empty(max(span, 1), dtype=t.dtype, device="cuda")
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _shorter_queries(varlen: dict) -> bool:
    """Whether a packed sequence has fewer queries than keys (a context-parallel chunk's documents);
    read from the real, host-side cumulative lengths before they are faked."""
    lq, lk = (varlen[name].diff() for name in ("cu_seqlens_q", "cu_seqlens_k"))
    return bool((lq < lk).any())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def answer_hardware_queries() -> None:
    """Give cutlass's ``HardwareInfo`` the target SKU instead of a driver. The persistent tile schedulers
    of the non-causal forward ask it for the SM count while tracing (``flash_attn/cute/
    tile_scheduler.py``, ``get_grid_shape``), which ``FLASH_ATTENTION_NUM_SMS`` does not cover; without
    a driver that is a ``DynamicLibNotFoundError``, not a finding about the kernel."""
    from cutlass.utils import hardware_info

    sms = int(os.environ["FLASH_ATTENTION_NUM_SMS"])
    cls = hardware_info.HardwareInfo
    cls.__init__ = lambda self, device_id=0: None
    cls.get_device_multiprocessor_count = lambda self: sms
    cls.get_max_active_clusters = lambda self, cluster_size, stream=None: sms // cluster_size
    cls.get_l2_cache_size_in_bytes = lambda self: 50 * 2**20


class CompilingInterface:
    """``flash_attn.cute.interface`` as the project calls it; each call compiles the real kernels on
    fake tensors (``_flash_attn_fwd``, then ``_flash_attn_bwd`` when an input requires grad) and
    returns zeros of the documented output shapes so the project's code runs on."""

    def __init__(self):
        from flash_attn.cute import interface

        answer_hardware_queries()
        self.real = interface
        self.calls: list[dict] = []
        self.case = ""

    def _compile(self, q, k, v, *, softmax_scale, causal, return_lse, varlen: dict | None):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        grad = any(t.requires_grad for t in (q, k, v))
        record = {
            "case": self.case,
            "q": list(q.shape),
            "k": list(k.shape),
            "v": list(v.shape),
            "v_strides": list(v.stride()),
            "gqa": q.shape[-2] // k.shape[-2],
            "causal": causal,
            "varlen": varlen is not None,
            "lq_lt_lk": (q.shape[-3] < k.shape[-3]) if varlen is None else _shorter_queries(varlen),
            "backward": grad,
            "return_lse": return_lse,
        }
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fq, fk, fv = (_fake_like(t, fake_mode) for t in (q, k, v))
        extra = {}
        if varlen is not None:
            extra = {
                "cu_seqlens_q": _fake_like(varlen["cu_seqlens_q"], fake_mode),
                "cu_seqlens_k": _fake_like(varlen["cu_seqlens_k"], fake_mode),
                "max_seqlen_q": varlen["max_seqlen_q"],
                "max_seqlen_k": varlen["max_seqlen_k"],
            }
        stage = "forward"
        start = time.perf_counter()
        try:
            with fake_mode:
                out, lse = self.real._flash_attn_fwd(
                    fq, fk, fv, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse or grad,
                    **extra,
                )[:2]  # fmt: skip
                record["fwd_s"] = round(time.perf_counter() - start, 3)
                if grad:  # what FlashAttnFunc / FlashAttnVarlenFunc.backward pass
                    stage = "backward"
                    start = time.perf_counter()
                    dlse = torch.empty_like(lse) if return_lse else None
                    self.real._flash_attn_bwd(
                        fq, fk, fv, out, torch.empty_like(out), lse, softmax_scale, causal, 0.0,
                        deterministic=False, dlse=dlse, **extra,
                    )  # fmt: skip
                    record["bwd_s"] = round(time.perf_counter() - start, 3)
            record["ok"] = True
        except Exception as exc:  # noqa: BLE001 - a refusal of the real kernel is the finding
            record.update(ok=False, stage=stage, error=_first_line(exc), where=_origin(exc))
        self.calls.append(record)

    def _outputs(self, q, v, return_lse, lse_shape):
        import torch

        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = torch.zeros(lse_shape) if return_lse or q.requires_grad else None
        return out, lse

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False, return_lse=False, **unused):
        assert not unused, f"the compile check does not replay {sorted(unused)}"
        self._compile(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, varlen=None)
        return self._outputs(q, v, return_lse, (q.shape[0], q.shape[2], q.shape[1]))

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, return_lse=False,
                               **unused):  # fmt: skip
        assert not unused, f"the compile check does not replay {sorted(unused)}"
        varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)  # fmt: skip
        self._compile(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, varlen=varlen
        )
        return self._outputs(q, v, return_lse, (q.shape[1], q.shape[0]))


# ---- the argument rules: the stand-in against the real interface's own checks ---------------------------
def _rule_cases(arch: int):
    """``(name, entry, q, k, v, options)``: calls that break one argument rule each, beside a valid varlen
    call of the shape context parallelism makes (two documents, fewer queries than keys) and a dense one."""
    import torch

    bf16, i32 = torch.bfloat16, torch.int32

    def qkv(total_q=12, total_k=20, heads=4, kv=2, d=64, dk=None, dv=None, total_v=None, dtype=bf16,
            kv_dtype=None):  # fmt: skip
        kv_dtype = kv_dtype or dtype
        return (
            torch.randn(total_q, heads, d, dtype=dtype),
            torch.randn(total_k, kv, dk or d, dtype=kv_dtype),
            torch.randn(total_v or total_k, kv, dv or d, dtype=kv_dtype),
        )

    cu = {
        "cu_seqlens_q": torch.tensor([0, 5, 12], dtype=i32),
        "cu_seqlens_k": torch.tensor([0, 8, 20], dtype=i32),
        "max_seqlen_q": 7,
        "max_seqlen_k": 12,
    }
    too_wide = 264 if arch // 10 == 9 else 160
    varlen = [
        ("cu_seqlens_q int64", qkv(), {**cu, "cu_seqlens_q": cu["cu_seqlens_q"].long()}),
        ("cu_seqlens_k int64", qkv(), {**cu, "cu_seqlens_k": cu["cu_seqlens_k"].long()}),
        ("cu_seqlens_k not contiguous", qkv(),
         {**cu, "cu_seqlens_k": torch.tensor([0, 0, 8, 0, 20, 0], dtype=i32)[::2]}),
        ("cu_seqlens_k of another batch size", qkv(),
         {**cu, "cu_seqlens_k": torch.tensor([0, 8, 14, 20], dtype=i32)}),
        ("fp32 inputs", qkv(dtype=torch.float32), cu),
        ("q bf16, k/v fp16", qkv(kv_dtype=torch.float16), cu),
        ("query heads not a multiple of KV heads", qkv(heads=3), cu),
        ("q and k head dims differ", qkv(dk=72), cu),
        ("k and v of different lengths", qkv(total_v=18), cu),
        ("head dim not a multiple of 8", qkv(d=60), cu),
        (f"head dim {too_wide} on SM{arch}", qkv(d=too_wide), cu),
    ]  # fmt: skip
    for name, (q, k, v), options in varlen:
        yield name, "varlen", q, k, v, options
    q, k, v = (t.unflatten(0, (2, 6)) for t in qkv(total_k=12))
    yield "k of another batch size (dense)", "func", q, k[:1], v[:1], {}


def argument_rules(real, arch: int) -> list[dict]:
    """Each rule-breaking call through the stand-in (``goat_dist/kernels/flash4_standin.py``, 16-bit inputs
    only, playing ``arch``; its refusal's ``rule``, the real interface's words) and through the real
    ``_flash_attn_fwd`` on fake CUDA tensors: whether each refuses, and with what. The real checks run before
    anything compiles, so this costs no kernel build; a call the real interface would accept is not run there
    (it would compile) but recorded as accepted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from goat_dist.kernels.flash4_standin import Flash4Standin, KernelRefusal

    standin = Flash4Standin(arch=arch)
    records = []
    for name, entry, q, k, v, options in _rule_cases(arch):
        record = {"rule": name}
        call = standin.flash_attn_varlen_func if entry == "varlen" else standin.flash_attn_func
        try:
            call(q, k, v, causal=True, softmax_scale=0.125, **options)
            record["standin"] = None
        except KernelRefusal as exc:  # its rule: the real interface's words, without the kernel's name
            record["standin"] = f"{type(exc).__name__}: {exc.rule}"
        except Exception as exc:  # noqa: BLE001 - the refusal is the record
            record["standin"] = _first_line(exc)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = {key: _fake_like(t, fake_mode) if hasattr(t, "shape") else t for key, t in options.items()}
        fq, fk, fv = (_fake_like(t, fake_mode) for t in (q, k, v))
        try:
            with fake_mode:
                _refuse_before_compile(real, fq, fk, fv, fake)
            record["real"] = None
        except _WouldCompile:
            record["real"] = None
        except Exception as exc:  # noqa: BLE001
            record["real"] = _first_line(exc)
        records.append(record)
    return records


class _WouldCompile(Exception):
    """The real interface accepted the arguments and went on to build a kernel."""


def _refuse_before_compile(real, q, k, v, options) -> None:
    """``_flash_attn_fwd`` up to its first kernel build: the build step raises ``_WouldCompile``."""
    import cutlass.cute as cute

    saved = cute.compile

    def stop(*args, **kwargs):
        raise _WouldCompile

    cute.compile = stop
    try:
        real._flash_attn_fwd(q, k, v, softmax_scale=0.125, causal=True, **options)
    finally:
        cute.compile = saved


def _origin(exc: BaseException) -> str:
    """file:line of the innermost frame inside flash_attn/cute (where the kernel refused)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flash_attn" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno}"
