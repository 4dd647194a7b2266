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
    fa4 = flash_imports._flash_attn_cute()
    if fa4 is None:
        backend.resolve_backend("flash4")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash_attn.cute does not import")
    dq, dv = q.shape[-1], v.shape[-1]
    if capability is backend.DEVICE:
        capability = backend.device_capability(q.device if q.is_cuda else None)
    major = capability[0] if capability else None
    wq, wv = fa4_dims.flash4_head_dims(dq, dv, major, gqa=q.shape[2] != k.shape[2])
    q, k = pad_to(q, wq), pad_to(k, wq)
    B, L, H = q.shape[:3]
    if segments is not None:
        cu, max_len = cu_seqlens(segments)
        q, k = q.flatten(0, 1), k.flatten(0, 1)
    outs, lse = [], None
    for first in range(0, dv, wv):  # one call unless v is wider than this GPU's kernel takes
        piece = pad_to(v[..., first : first + wv], wv)
        want_lse = return_lse and first == 0  # the same for every v slice: keep the first
        if segments is None:
            out, piece_lse = fa4.flash_attn_func(
                q, k, piece, softmax_scale=scale, causal=causal, return_lse=want_lse
            )
        else:
            out, piece_lse = fa4.flash_attn_varlen_func(
                q,
                k,
                piece.flatten(0, 1),
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                softmax_scale=scale,
                causal=causal,
                return_lse=want_lse,
            )
            out = out.view(B, L, *out.shape[1:])
        outs.append(out[..., : min(wv, dv - first)])
        lse = piece_lse if lse is None else lse
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if not return_lse:
        return out
    if segments is not None:  # varlen: (H, total) -> (B, H, L)
        lse = lse.view(H, B, L).transpose(0, 1)
    return out, lse
