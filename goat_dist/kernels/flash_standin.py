"""A plain-torch stand-in for flash-attn 2's public interface (``flash_attn``) that applies the real
kernel's input rules.

The product holds it for two callers: ``goat-dist plan --rehearse``, which runs one rank's real training
step on the meta device, where the model's flash-attn 2 calls must meet the rules an A100 would apply
(``installed`` puts it in place of the real module; a call the real kernel would refuse raises
``KernelRefusal``), and the tests, which run the project's flash paths on CPU against it.

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
last dim, head dims above 256, a value head dim different from the query's, H not a multiple of H_kv, and
cu_seqlens that are not int32 or not contiguous: ``KernelRefusal`` (a RuntimeError, as the real C++
checks raise), whose ``rule`` is the real message. And like the real kernel on a GPU (a "misaligned
address" fault) it refuses a tensor it cannot load 16 bytes at a time: a data pointer or a batch / token
/ head stride off a 16-byte boundary, for a head dim that is a multiple of 8. The kernels copy global
memory in ``uint128_t`` units (``csrc/flash_attn/src/kernel_traits.h``:
``SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>``, ``kGmemElemsPerLoad``); the C++ entry checks only
``stride(-1) == 1`` (``csrc/flash_attn/flash_api.cpp``) and the Python wrapper only fixes that stride
(``flash_attn/flash_attn_interface.py``: ``maybe_contiguous``) or pads a head dim that is not a multiple
of 8, which makes a fresh copy (the same file, ``head_size_og % 8``). A view of a fused projection, v of
the 125M config (212 bytes in, heads 340 bytes apart), is such a tensor.
``FlashStandin(allow_fp32=True)`` is the explicit switch that also accepts fp32, for exact comparisons
against sdpa at 1e-5 (the 16-byte rule then counts fp32 bytes).

Numerics follow the kernel's contract: bf16/fp16 inputs upcast exactly, logits and softmax in fp32, the
probabilities rounded to the input dtype before the (fp32-accumulated) product with V, output in the
input dtype. Dropout, sliding windows, softcapping and paged KV are not implemented and raise
NotImplementedError. Gradients come from torch autograd through the same computation.

Meta tensors (the rehearsal): every rule that needs no data still runs (dtypes, shapes, head dims,
cu_seqlens' dtype and contiguity, and the 16-byte rule: a meta tensor's data pointer is its byte offset
into its storage), and the outputs have the documented shapes and dtypes and stay on the autograd
graph. What needs the values of meta ``cu_seqlens`` is skipped: that they start at 0, end at the packed
totals and do not decrease, the lengths against ``max_seqlen_q/k`` (host ints) and the per-sequence
masks; such a varlen call attends over all packed tokens as one sequence (the same shapes).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import torch

from .refusal import KernelRefusal

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
    @staticmethod
    def _refuse(entry: str, rule: str, got: str | None = None) -> KernelRefusal:
        return KernelRefusal(f"flash-attn 2 {entry}", rule, got)

    def _check(self, entry: str, q, k, v, alibi_slopes, batch: int) -> None:
        dtypes = f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        if q.dtype not in allowed:
            raise self._refuse(entry, "FlashAttention only support fp16 and bf16 data type", dtypes)
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise self._refuse(entry, "query and key/value must have the same dtype", dtypes)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                got = f"{name} of strides {t.stride()}"
                raise self._refuse(entry, "Input tensor must have contiguous last dimension", got)
            if not loadable_16_bytes_at_a_time(t):
                rule = (
                    "CUDA error: misaligned address (flash-attn 2 loads 16-byte vectors: data pointer "
                    f"{t.data_ptr() % ALIGN_BYTES} bytes off, strides {t.stride()} of "
                    f"{t.element_size()}-byte elements)"
                )
                raise self._refuse(entry, rule, name)
        D = q.shape[-1]
        if D > MAX_HEAD_DIM:
            rule = f"FlashAttention forward only supports head dimension at most {MAX_HEAD_DIM}"
            raise self._refuse(entry, rule, f"head dim {D}")
        if k.shape[-1] != D or v.shape[-1] != D:
            got = f"q {D}, k {k.shape[-1]}, v {v.shape[-1]}"
            raise self._refuse(entry, "q, k and v must have the same head dimension (flash-attn 2)", got)
        if q.shape[-2] % k.shape[-2] or k.shape[-2] != v.shape[-2]:
            rule = "Number of heads in key/value must divide number of heads in query"
            raise self._refuse(entry, rule, f"q {q.shape[-2]}, k {k.shape[-2]}, v {v.shape[-2]} heads")
        if alibi_slopes is not None:
            if alibi_slopes.dtype != torch.float32:
                raise self._refuse(entry, "ALiBi slopes must have dtype fp32", str(alibi_slopes.dtype))
            H = q.shape[-2]
            if tuple(alibi_slopes.shape) not in ((H,), (batch, H)):
                rule = "ALiBi slopes batch must have shape (nheads) or (batch_size, nheads)"
                raise self._refuse(entry, rule, f"shape {tuple(alibi_slopes.shape)}")

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
            stop = min(start + _QUERY_BLOCK, Lq)
            rows = torch.arange(start, stop, device=q.device)
            diagonal = rows[:, None] + (Lk - Lq)  # bottom-right aligned query index in key coordinates
            # causal: keys past the block's last diagonal are masked for every row; skip computing them
            # (the bound from the sizes alone, so it needs no data on meta tensors)
            width = min(Lk, max(stop + Lk - Lq, 1)) if causal and stop > start else Lk
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
        entry = "flash_attn_func"
        self.calls.append(entry)
        self._unsupported(dropout_p, window_size, softcap)
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise self._refuse(entry, "flash_attn_func takes (batch, seqlen, nheads, headdim) tensors")
        B = q.shape[0]
        self._check(entry, q, k, v, alibi_slopes, B)
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
        entry = "flash_attn_varlen_func"
        self.calls.append(entry)
        self._unsupported(dropout_p, window_size, softcap, block_table)
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise self._refuse(entry, "flash_attn_varlen_func takes packed (total, nheads, headdim) tensors")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32:
                raise self._refuse(entry, f"{name} must have dtype int32", str(cu.dtype))
            if cu.dim() != 1 or not cu.is_contiguous():
                got = f"shape {tuple(cu.shape)}, strides {cu.stride()}"
                raise self._refuse(entry, f"{name} must be a contiguous 1-D tensor", got)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            rule = "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)"
            raise self._refuse(entry, rule, f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
        batch = cu_seqlens_q.numel() - 1
        self._check(entry, q, k, v, alibi_slopes, batch)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        probs = q.new_zeros(batch, q.shape[1], max_seqlen_q, max_seqlen_k, dtype=torch.float32)
        if cu_seqlens_q.is_meta or cu_seqlens_k.is_meta:  # no lengths: all packed tokens as one sequence
            out, lse, _ = self._attend_one(q, k, v, scale, causal, _row_slopes(alibi_slopes, 0))
            return (out, lse, probs) if return_attn_probs else out
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if bq[0] != 0 or bk[0] != 0 or bq[-1] != q.shape[0] or bk[-1] != k.shape[0]:
            rule = "cu_seqlens must start at 0 and end at the number of packed tokens"
            raise self._refuse(entry, rule, f"cu_seqlens_q {bq}, cu_seqlens_k {bk}")
        len_q = [b - a for a, b in zip(bq, bq[1:])]
        len_k = [b - a for a, b in zip(bk, bk[1:])]
        if min(len_q + len_k) < 0 or max(len_q) > max_seqlen_q or max(len_k) > max_seqlen_k:
            rule = "cu_seqlens are not increasing or exceed max_seqlen_q/max_seqlen_k"
            got = f"cu_seqlens_q {bq}, cu_seqlens_k {bk}, max_seqlen {max_seqlen_q}/{max_seqlen_k}"
            raise self._refuse(entry, rule, got)
        outs, lses = [], []
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
        module.__doc__ = "stand-in for flash-attn (goat_dist/kernels/flash_standin.py)"
        vars(module).update(
            flash_attn_func=self.flash_attn_func,
            flash_attn_varlen_func=self.flash_attn_varlen_func,
            __version__="2.standin",
        )
        return module


def _row_slopes(alibi_slopes, b: int):
    if alibi_slopes is None:
        return None
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]


@contextlib.contextmanager
def installed(
    standin: FlashStandin | None = None, capability: tuple[int, int] | None = None, *, arch: int = 80
):
    """Make ``import flash_attn`` return ``standin`` (default: a strict ``FlashStandin``) and let
    ``goat_dist`` use it without CUDA; yields the stand-in.

    The project imports flash-attn lazily (``goat_dist.kernels.flash_imports._flash_attn``, cached): the
    cache is cleared on entry and exit, so a real install is seen again afterwards. flash-attn 2 also
    needs a CUDA GPU of compute capability 8.0 or newer: the device the project queries
    (``kernels.backend.device_capability``) plays one, ``capability`` (default: ``arch``, an A100's
    8.0), for the duration, so ``resolve_backend("auto")`` picks flash there.
    """
    from . import backend, flash_imports

    standin = FlashStandin() if standin is None else standin
    major, minor = capability or divmod(arch, 10)
    saved = sys.modules.get("flash_attn")
    sys.modules["flash_attn"] = standin.as_module()
    flash_imports._flash_attn.cache_clear()
    original = backend.device_capability
    backend.device_capability = lambda device=None: (major, minor)
    try:
        yield standin
    finally:
        backend.device_capability = original
        if saved is None:
            sys.modules.pop("flash_attn", None)
        else:
            sys.modules["flash_attn"] = saved
        flash_imports._flash_attn.cache_clear()
