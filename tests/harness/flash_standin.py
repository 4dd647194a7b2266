"""A plain-torch stand-in for flash-attn 2's public interface, so the project's flash code paths run on CPU.

Written from the documented interface (``flash_attn.flash_attn_interface`` docstrings and the checks of
its C++ entry points), not from its kernels:

* ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
  deterministic, return_attn_probs)`` with q (B, Lq, H, D), k and v (B, Lk, H_kv, D);
* ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` with
  packed q (total_q, H, D), k and v (total_k, H_kv, D) and int32 cumulative lengths (batch + 1,);
* GQA: H a multiple of H_kv, query head h reads KV head ``h // (H / H_kv)``;
* causal masks aligned to the bottom-right corner when Lq != Lk (query i sees keys j <= i + Lk - Lq;
  a row that sees nothing outputs zeros); ``alibi_slopes`` (H,) or (B, H) fp32 add
  ``-slope * |i + Lk - Lq - j|``;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: softmax_lse fp32, (B, H, Lq) or
  (H, total_q) for varlen, the log-sum-exp of each row of scaled logits (+inf for an empty row);
  S_dmask the probabilities, (B, H, Lq, Lk) (varlen: zero-padded to max_seqlen).

Like the real kernel it rejects inputs other than fp16/bf16, q/k/v of different dtypes, a non-contiguous
last dim, head dims above 256, a value head dim different from the query's, H not a multiple of H_kv,
and cu_seqlens that are not int32. And like the real kernel on a GPU (a "misaligned address" fault) it
refuses a tensor it cannot load 16 bytes at a time: a data pointer or a batch / token / head stride off
a 16-byte boundary, for a head dim that is a multiple of 8. The kernels copy global memory in
``uint128_t`` units (``csrc/flash_attn/src/kernel_traits.h``: ``SM80_CP_ASYNC_CACHEGLOBAL<cute::
uint128_t>``, ``kGmemElemsPerLoad``); the C++ entry checks only ``stride(-1) == 1``
(``csrc/flash_attn/flash_api.cpp``) and the Python wrapper only fixes that stride
(``flash_attn/flash_attn_interface.py``: ``maybe_contiguous``) or pads a head dim that is not a
multiple of 8, which makes a fresh copy (the same file, ``head_size_og % 8``). A view of a fused
projection, v of the 125M config (212 bytes in, heads 340 bytes apart), is such a tensor.
``FlashStandin(allow_fp32=True)`` is the explicit switch that also accepts fp32, for exact comparisons
against sdpa at 1e-5 (the 16-byte rule then counts fp32 bytes).

Numerics follow the kernel's contract: bf16/fp16 inputs upcast exactly, logits and softmax in fp32, the
probabilities rounded to the input dtype before the (fp32-accumulated) product with V, output in the
input dtype. Dropout, sliding windows, softcapping and paged KV are not implemented and raise.
Gradients come from torch autograd through the same computation.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import torch

MAX_HEAD_DIM = 256
ALIGN_BYTES = 16  # one uint128_t global-memory load


def loadable_16_bytes_at_a_time(t: torch.Tensor) -> bool:
    """The data pointer and every stride but the last on 16-byte boundaries (a head dim that is not a
    multiple of 8 is padded into a fresh copy by the wrapper first)."""
    if t.shape[-1] % 8:
        return True
    size = t.element_size()
    strides = [s for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1]
    return t.data_ptr() % ALIGN_BYTES == 0 and all(s * size % ALIGN_BYTES == 0 for s in strides)


_QUERY_BLOCK = 1024  # rows per block: bounds the (block, Lk) logits held at once in no-grad runs


class FlashStandin:
    """The stand-in's two functions, bound to one dtype policy (``allow_fp32``)."""

    def __init__(self, allow_fp32: bool = False):
        self.allow_fp32 = allow_fp32
        self.calls: list[str] = []  # which entry points ran: tests assert the flash path was taken

    # ---- input checks (the real kernel's) ------------------------------------------------------------
    def _check(self, q, k, v, alibi_slopes, batch: int) -> None:
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        if q.dtype not in allowed:
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError("query and key/value must have the same dtype")
        for t in (q, k, v):
            if t.stride(-1) != 1:
                raise RuntimeError("Input tensor must have contiguous last dimension")
            if not loadable_16_bytes_at_a_time(t):
                raise RuntimeError(
                    "CUDA error: misaligned address (flash-attn 2 loads 16-byte vectors: data pointer "
                    f"{t.data_ptr() % ALIGN_BYTES} bytes off, strides {t.stride()} of "
                    f"{t.element_size()}-byte elements)"
                )
        D = q.shape[-1]
        if D > MAX_HEAD_DIM:
            raise RuntimeError(f"FlashAttention forward only supports head dimension at most {MAX_HEAD_DIM}")
        if k.shape[-1] != D or v.shape[-1] != D:
            raise RuntimeError("q, k and v must have the same head dimension (flash-attn 2)")
        if q.shape[-2] % k.shape[-2] or k.shape[-2] != v.shape[-2]:
            raise RuntimeError("Number of heads in key/value must divide number of heads in query")
        if alibi_slopes is not None:
            if alibi_slopes.dtype != torch.float32:
                raise RuntimeError("ALiBi slopes must have dtype fp32")
            H = q.shape[-2]
            if tuple(alibi_slopes.shape) not in ((H,), (batch, H)):
                raise RuntimeError("ALiBi slopes batch must have shape (nheads) or (batch_size, nheads)")

    @staticmethod
    def _unsupported(dropout_p, window_size, softcap, block_table=None) -> None:
        if dropout_p:
            raise NotImplementedError("flash stand-in: dropout is not implemented")
        if tuple(window_size) != (-1, -1):
            raise NotImplementedError("flash stand-in: sliding windows are not implemented")
        if softcap:
            raise NotImplementedError("flash stand-in: softcapping is not implemented")
        if block_table is not None:
            raise NotImplementedError("flash stand-in: paged KV caches are not implemented")

    # ---- one sequence ---------------------------------------------------------------------------------
    def _attend_one(self, q, k, v, scale, causal, slopes, want_probs=False):
        """q (Lq, H, D), k/v (Lk, H_kv, D), slopes (H,) or None -> out (Lq, H, D), lse (H, Lq) and the
        probabilities (H, Lq, Lk) when ``want_probs`` (else None)."""
        Lq, H, _ = q.shape
        Lk = k.shape[0]
        group = H // k.shape[1]
        qf = q.float().transpose(0, 1)  # (H, Lq, D): bf16/fp16 -> fp32 is exact
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        outs, lses, probs = [], [], []
        for start in range(0, max(Lq, 1), _QUERY_BLOCK):
            rows = torch.arange(start, min(start + _QUERY_BLOCK, Lq), device=q.device)
            diagonal = rows[:, None] + (Lk - Lq)  # bottom-right aligned query index in key coordinates
            # causal: keys past the block's last diagonal are masked for every row; skip computing them
            width = min(Lk, max(int(diagonal[-1]) + 1, 1)) if causal and len(rows) else Lk
            cols = torch.arange(width, device=q.device)[None, :]
            logits = torch.matmul(qf[:, rows], kf[:, :width].transpose(1, 2)) * scale  # (H, rows, width)
            if slopes is not None:
                logits = logits - slopes.float()[:, None, None] * (diagonal - cols).abs()
            empty = torch.zeros(len(rows), dtype=torch.bool, device=q.device)
            if causal:
                masked = cols > diagonal
                empty = masked.all(dim=-1)  # a row that sees no key: zeros out, +inf lse (no NaN grads)
                logits = logits.masked_fill(masked, float("-inf")).masked_fill(empty[:, None], 0.0)
            lse = torch.logsumexp(logits, dim=-1)  # (H, rows)
            p = torch.softmax(logits, dim=-1) * (~empty)[:, None]
            outs.append(torch.matmul(p.to(q.dtype).float(), vf[:, :width]))
            lses.append(lse.masked_fill(empty, math.inf))
            if want_probs:
                probs.append(torch.nn.functional.pad(p, (0, Lk - width)))
        out = torch.cat(outs, dim=1).transpose(0, 1).to(q.dtype)
        return out, torch.cat(lses, dim=1), torch.cat(probs, dim=1) if want_probs else None

    # ---- flash_attn_func ------------------------------------------------------------------------------
    def flash_attn_func(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        self.calls.append("flash_attn_func")
        self._unsupported(dropout_p, window_size, softcap)
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise RuntimeError("flash_attn_func takes (batch, seqlen, nheads, headdim) tensors")
        B = q.shape[0]
        self._check(q, k, v, alibi_slopes, B)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        results = [
            self._attend_one(q[b], k[b], v[b], scale, causal, _row_slopes(alibi_slopes, b), return_attn_probs)
            for b in range(B)
        ]
        out = torch.stack([r[0] for r in results])
        if not return_attn_probs:
            return out
        return out, torch.stack([r[1] for r in results]), torch.stack([r[2] for r in results])

    # ---- flash_attn_varlen_func -----------------------------------------------------------------------
    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append("flash_attn_varlen_func")
        self._unsupported(dropout_p, window_size, softcap, block_table)
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise RuntimeError("flash_attn_varlen_func takes packed (total, nheads, headdim) tensors")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32:
                raise RuntimeError(f"{name} must have dtype int32")
            if cu.dim() != 1 or not cu.is_contiguous():
                raise RuntimeError(f"{name} must be a contiguous 1-D tensor")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
        batch = cu_seqlens_q.numel() - 1
        self._check(q, k, v, alibi_slopes, batch)
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if bq[0] != 0 or bk[0] != 0 or bq[-1] != q.shape[0] or bk[-1] != k.shape[0]:
            raise RuntimeError("cu_seqlens must start at 0 and end at the number of packed tokens")
        len_q = [b - a for a, b in zip(bq, bq[1:])]
        len_k = [b - a for a, b in zip(bk, bk[1:])]
        if min(len_q + len_k) < 0 or max(len_q) > max_seqlen_q or max(len_k) > max_seqlen_k:
            raise RuntimeError("cu_seqlens are not increasing or exceed max_seqlen_q/max_seqlen_k")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        outs, lses = [], []
        probs = q.new_zeros(batch, q.shape[1], max_seqlen_q, max_seqlen_k, dtype=torch.float32)
        for b in range(batch):
            sq, sk = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
            out, lse, p = self._attend_one(
                q[sq], k[sk], v[sk], scale, causal, _row_slopes(alibi_slopes, b), return_attn_probs
            )
            outs.append(out)
            lses.append(lse)
            if return_attn_probs:
                probs[b, :, : len_q[b], : len_k[b]] = p.detach()
        out = torch.cat(outs)
        if not return_attn_probs:
            return out
        return out, torch.cat(lses, dim=1), probs

    # ---- injection --------------------------------------------------------------------------------------
    def as_module(self) -> types.ModuleType:
        """A ``flash_attn`` module object exposing this stand-in's two functions."""
        module = types.ModuleType("flash_attn")
        module.__doc__ = "test stand-in for flash-attn (tests/harness/flash_standin.py)"
        module.flash_attn_func = self.flash_attn_func
        module.flash_attn_varlen_func = self.flash_attn_varlen_func
        module.__version__ = "2.standin"
        return module


def _row_slopes(alibi_slopes, b: int):
    if alibi_slopes is None:
        return None
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]


@contextlib.contextmanager
def installed(standin: FlashStandin, capability: tuple[int, int] = (8, 0)):
    """Make ``import flash_attn`` return ``standin`` and let ``goat_dist`` use it on CPU.

    The project imports flash-attn lazily (``goat_dist.kernels.flash_imports._flash_attn``, cached): the
    cache is cleared on entry and exit, so a real install is seen again afterwards. flash-attn 2 also
    needs a CUDA GPU of compute capability 8.0 or newer: the device the project queries
    (``kernels.backend.device_capability``) plays one, ``capability``, for the duration.
    """
    from goat_dist.kernels import backend, flash_imports

    saved = sys.modules.get("flash_attn")
    sys.modules["flash_attn"] = standin.as_module()
    flash_imports._flash_attn.cache_clear()
    original = backend.device_capability
    backend.device_capability = lambda device=None: tuple(capability)
    try:
        yield standin
    finally:
        backend.device_capability = original
        if saved is None:
            sys.modules.pop("flash_attn", None)
        else:
            sys.modules["flash_attn"] = saved
        flash_imports._flash_attn.cache_clear()
