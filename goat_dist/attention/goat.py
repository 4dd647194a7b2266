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
    origin: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax_j(q_c,i . k_c,j / sqrt(d_c) + K_ij) v_j`` for every head.

    q_content (B, L, H, d_c), k_content (B, L, H_kv, d_c), v (B, L, H_kv, D_v); ``position_ids`` (B, L)
    are absolute positions (packed documents, offsets, context-parallel chunks); ``segments`` (B, L),
    from ``document_segments``, keep attention inside packed documents; ``origin`` (B, 1) is the
    per-sequence constant the recency is measured from (default: from ``position_ids``; a
    context-parallel rank passes the whole row's, see ``sequence_origin``).

    ``eager`` adds the explicit log-prior matrix; the other backends append ``prior.num_lanes`` lanes to
    q and k, so one unmodified kernel call computes content + prior with no bias tensor. The lanes are
    built for the kernel's input dtype (q's), exact in bf16/fp16 up to one rounding of per-head spectral
    coefficients. The prior is not divided by the temperature: the kernel's scale is ``1/sqrt(d_c)`` and
    the lanes carry ``sqrt(d_c)``. Usually ``d_c + num_lanes == D_v`` (flash-attn 2 wants equal head
    dims); a module converted from the reference keeps the reference's ``d_c`` and has wider q/k.
    """
    d_c = q_content.shape[-1]
    scale = 1.0 / math.sqrt(d_c)
    if backend == "eager":
        bias = prior.log_prior(position_ids, causal, origin)
        return eager_attention(
            q_content, k_content, v, causal=causal, scale=scale, bias=bias, segments=segments
        )
    q, k = fold_prior(q_content, k_content, prior, position_ids, causal=causal, origin=origin)
    return attend(q, k, v, causal=causal, scale=scale, backend=backend, segments=segments)


def fold_prior(
    q_content: torch.Tensor,
    k_content: torch.Tensor,
    prior: GoatPrior,
    position_ids: torch.Tensor,
    *,
    causal: bool,
    origin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with the prior's lanes appended (for a kernel whose scale is ``1/sqrt(d_c)``).

    Each token's lanes depend only on its own global position and the row's ``origin``: a
    context-parallel rank folds its own chunks and exchanges the folded keys."""
    scale = 1.0 / math.sqrt(q_content.shape[-1])
    q_lanes, k_lanes = prior.lanes(position_ids, causal, scale=scale, dtype=q_content.dtype, origin=origin)
    group = q_content.shape[2] // k_content.shape[2]
    if group > 1:
        q_lanes = q_lanes.repeat_interleave(group, dim=2)
    return torch.cat([q_content, q_lanes], dim=-1), torch.cat([k_content, k_lanes], dim=-1)


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
