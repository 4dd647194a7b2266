"""FlashAttention-4's interface, recording and compiling instead of running (``tests/fa4_compile.py``):
each ``flash_attn_func`` / ``flash_attn_varlen_func`` call the project makes is replayed on fake CUDA
tensors of the same shapes and strides through FA4's ``_flash_attn_fwd`` and, for inputs that require
grad, ``_flash_attn_bwd``, which compiles the real kernels (and runs their checks) without a GPU."""

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
            "lq_lt_lk": (q.shape[-3] < k.shape[-3]) if varlen is None else None,
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


def _origin(exc: BaseException) -> str:
    """file:line of the innermost frame inside flash_attn/cute (where the kernel refused)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flash_attn" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno}"
