"""torch's kernels: ``sdpa`` (``F.scaled_dot_product_attention``) and ``eager`` (explicit fp32 logits,
the readable reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import pad_v
from .masks import segment_mask


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, S, H_kv, D) -> (B, S, n_heads, D): each KV head repeated for its query group (GQA)."""
    group = n_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Readable reference: explicit fp32 logits ``scale * q.k + bias``, mask, softmax, weighted sum.

    ``bias`` is (B, H or H_kv, L, S) and is added unscaled; ``segments`` (B, L) confine attention to
    packed documents. ``return_lse``: also the log-sum-exp of each row's logits, (B, H, L) fp32.
    """
    H = q.shape[2]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * scale
    if bias is not None:
        logits = logits + (bias if bias.shape[1] == H else bias.repeat_interleave(H // bias.shape[1], dim=1))
    if segments is not None:
        logits = logits.masked_fill(~segment_mask(segments, causal), float("-inf"))
    elif causal:
        L, S = logits.shape[-2:]
        future = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(S - L + 1)
        logits = logits.masked_fill(future, float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.einsum("bhls,bshd->blhd", probs, v.float()).to(v.dtype)
    return (out, torch.logsumexp(logits, dim=-1)) if return_lse else out


def sdpa_call(q, k, v, *, scale: float, mask=None, causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on batch-first (B, L, H, D) tensors, GQA included; a v narrower
    than q/k is zero-padded and the output cut back (``pad_v``): with unequal head dims SDPA falls back
    to its math kernel, which materialises the L x L probabilities (gigabytes at L = 32k)."""
    v, dv = pad_v(v, q.shape[-1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)[..., :dv]


def sdpa_attention(q, k, v, *, causal: bool, scale: float, segments=None, bias=None) -> torch.Tensor:
    """torch SDPA; packed documents (``segments``) or an additive ``bias`` go in as an explicit mask."""
    mask = None
    if segments is not None or bias is not None:
        keep = segment_mask(segments, causal) if segments is not None else None
        if keep is None and causal:
            L = q.shape[1]
            keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf")).to(q.dtype)
    return sdpa_call(q, k, v, scale=scale, mask=mask, causal=causal and mask is None)
