"""The prior folded into q and k (``fold_prior``): ``prior.num_lanes`` lanes appended to each q/k head,
so one unmodified kernel call computes content + prior; and the grouped fused q/k/v projection layout
(``split_grouped_qkv``) whose q/k heads carry those lanes."""

from __future__ import annotations

import math

import torch

from ..shapes import grouped_qkv_width
from .prior import GoatPrior

__all__ = ["fold_prior", "goat_kernel_inputs", "grouped_qkv_width", "split_grouped_qkv"]


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


def goat_kernel_inputs(q_content, k_content, prior: GoatPrior, position_ids, *, causal, backend, origin=None):
    """(q, k, scale, bias) for one kernel call: ``eager`` gets the explicit log-prior matrix as ``bias``
    beside the content q/k (the readable reference); every other backend gets the lanes folded into q
    and k (``fold_prior``) and no bias. The scale is ``1/sqrt(d_c)`` either way."""
    scale = 1.0 / math.sqrt(q_content.shape[-1])
    if backend == "eager":
        return q_content, k_content, scale, prior.log_prior(position_ids, causal, origin)
    q, k = fold_prior(q_content, k_content, prior, position_ids, causal=causal, origin=origin)
    return q, k, scale, None


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
