"""FlashAttention-4 (``flash_attn.cute.interface``, PyPI ``flash-attn-4``), imported lazily."""

from __future__ import annotations

import torch

from . import backend, fa4_dims, flash_imports
from .layout import pad_to
from .masks import cu_seqlens


def flash4_attention(
    q, k, v, *, causal: bool, scale: float, segments=None, return_lse: bool = False, capability=backend.DEVICE
):
    """FlashAttention-4; packed documents run through its varlen kernel.

    FA4 takes different q/k and v head dims, under GQA fewer pairs in its backward; widths are padded
    or v sliced as ``flash4_head_dims`` says for the GPU of compute ``capability`` (default: q's
    device's). ``return_lse``: also the log-sum-exp of each row's scaled logits, (B, H, L) fp32
    (natural log; -inf for a row that sees no key), differentiable (context parallelism merges partial
    results with it).
    """
    if segments is None:
        return _flash4(
            q, k, v, None, causal=causal, scale=scale, return_lse=return_lse, capability=capability
        )
    B, L, H = q.shape[:3]
    cu, max_len = cu_seqlens(segments)
    result = _flash4(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        (cu, cu, max_len, max_len),
        causal=causal,
        scale=scale,
        return_lse=return_lse,
        capability=capability,
    )
    out = (result[0] if return_lse else result).view(B, L, H, -1)
    if not return_lse:
        return out
    return out, result[1].view(H, B, L).transpose(0, 1)  # varlen: (H, total) -> (B, H, L)


def flash4_varlen(
    q,
    k,
    v,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    scale: float,
    return_lse: bool = False,
    capability=backend.DEVICE,
):
    """FlashAttention-4's varlen kernel on packed sequences whose query and key lengths may differ:
    q (total_q, H, D), k (total_k, H_kv, D), v (total_k, H_kv, Dv); sequence i is queries
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` against keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``
    (int32, (n + 1,)), ``max_seqlen_*`` the longest of each (host ints: they size the kernel's grid).
    A causal mask is aligned bottom-right in each sequence (query i of Lq sees keys j <= i + Lk - Lq),
    which is what a context-parallel chunk of a document needs against that document's key prefix
    (``chunks.prefix_attention``). Returns out (total_q, H, Dv) and, with ``return_lse``, lse
    (H, total_q) fp32. Head dims as ``flash4_attention``."""
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _flash4(q, k, v, varlen, causal=causal, scale=scale, return_lse=return_lse, capability=capability)


def _flash4(q, k, v, varlen, *, causal, scale, return_lse, capability):
    """One FA4 call (``flash_attn_func``, or ``flash_attn_varlen_func`` when ``varlen`` is
    (cu_q, cu_k, max_q, max_k) and q/k/v are packed), in the head widths this GPU's kernels take:
    q/k padded, v padded or in slices (attention is linear in v; the lse is the same for every slice)."""
    fa4 = flash_imports._flash_attn_cute()
    if fa4 is None:
        backend.resolve_backend("flash4")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash_attn.cute does not import")
    dq, dv = q.shape[-1], v.shape[-1]
    if capability is backend.DEVICE:
        capability = backend.device_capability(q.device if q.is_cuda else None)
    major = capability[0] if capability else None
    wq, wv = fa4_dims.flash4_head_dims(dq, dv, major, gqa=q.shape[-2] != k.shape[-2])
    q, k = pad_to(q, wq), pad_to(k, wq)
    outs, lse = [], None
    for first in range(0, dv, wv):  # one call unless v is wider than this GPU's kernel takes
        piece = pad_to(v[..., first : first + wv], wv)
        want_lse = return_lse and first == 0  # the same for every v slice: keep the first
        if varlen is None:
            out, piece_lse = fa4.flash_attn_func(
                q, k, piece, softmax_scale=scale, causal=causal, return_lse=want_lse
            )
        else:
            cu_q, cu_k, max_q, max_k = varlen
            out, piece_lse = fa4.flash_attn_varlen_func(
                q,
                k,
                piece,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=scale,
                causal=causal,
                return_lse=want_lse,
            )
        outs.append(out[..., : min(wv, dv - first)])
        lse = piece_lse if lse is None else lse
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return (out, lse) if return_lse else out
