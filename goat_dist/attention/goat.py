"""GOAT attention as one function: content + prior in a single attention call."""

from __future__ import annotations

import math

import torch

from .kernels import attend, eager_attention
from .prior import GoatPrior


def goat_attention(
    q_content: torch.Tensor,
    k_content: torch.Tensor,
    v: torch.Tensor,
    prior: GoatPrior,
    position_ids: torch.Tensor,
    *,
    causal: bool,
    backend: str,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax_j(q_c,i . k_c,j / sqrt(d_c) + K_ij) v_j`` for every head.

    q_content (B, L, H, d_c), k_content (B, L, H_kv, d_c), v (B, L, H_kv, D) with ``D = d_c + 2R + 1``;
    ``position_ids`` (B, L) are absolute positions (packed documents, offsets, context-parallel chunks);
    ``segments`` (B, L), from ``document_segments``, keep attention inside packed documents.
    ``eager`` adds the explicit log-prior matrix; the other backends fold the prior into ``2R+1`` extra
    q/k lanes, so the kernel sees equal head dims for q, k and v and needs no bias tensor. The prior is
    not divided by the temperature: the kernel's scale is ``1/sqrt(d_c)`` and the query lanes carry
    ``sqrt(d_c)``.
    """
    d_c = q_content.shape[-1]
    if d_c + prior.num_lanes != v.shape[-1]:
        raise ValueError(
            f"content dim {d_c} + prior lanes {prior.num_lanes} must equal the value head dim {v.shape[-1]}"
        )
    scale = 1.0 / math.sqrt(d_c)
    if backend == "eager":
        bias = prior.log_prior(position_ids, causal)
        return eager_attention(
            q_content, k_content, v, causal=causal, scale=scale, bias=bias, segments=segments
        )
    q_lanes, k_lanes = prior.lanes(position_ids, causal)
    group = q_content.shape[2] // k_content.shape[2]
    if group > 1:
        q_lanes = q_lanes.repeat_interleave(group, dim=2)
    # The kernel applies 1/sqrt(d_c) to every lane, so the query lanes carry sqrt(d_c) to cancel it:
    # cheaper than rescaling all content lanes, and exact in bf16 up to one rounding of the lanes.
    q = torch.cat([q_content, (q_lanes * math.sqrt(d_c)).to(q_content.dtype)], dim=-1)
    k = torch.cat([k_content, k_lanes.to(k_content.dtype)], dim=-1)
    return attend(q, k, v, causal=causal, scale=scale, backend=backend, segments=segments)


def split_grouped_qkv(mixed: torch.Tensor, num_kv_heads: int, group: int, content_dim: int, head_dim: int):
    """Split a fused projection laid out per KV group as ``[q_1..q_group | k | v]``.

    Per group: ``group`` query heads and one key head of ``content_dim`` each, one value head of
    ``head_dim``. Grouping by KV head keeps each tensor-parallel shard of the fused projection
    self-contained (a rank owns whole groups). ``mixed`` is (..., num_kv_heads * per_group); returns
    q (..., H, d_c), k (..., H_kv, d_c), v (..., H_kv, D).
    """
    lead = mixed.shape[:-1]
    mixed = mixed.view(*lead, num_kv_heads, (group + 1) * content_dim + head_dim)
    q, k, v = mixed.split([group * content_dim, content_dim, head_dim], dim=-1)
    return q.reshape(*lead, num_kv_heads * group, content_dim), k, v


def grouped_qkv_width(num_kv_heads: int, group: int, content_dim: int, head_dim: int) -> int:
    return num_kv_heads * ((group + 1) * content_dim + head_dim)
