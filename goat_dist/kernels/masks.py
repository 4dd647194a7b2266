"""What kernels are told besides q, k and v: packed-document segments (dense masks and the varlen
kernels' cumulative lengths) and ALiBi's additive bias."""

from __future__ import annotations

import torch


def document_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Segment ids (B, L) of packed documents, from positions that restart (``t != t_prev + 1``);
    None when no row has a boundary, so unpacked batches keep the plain causal fast path."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1)


def segment_mask(segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, L, L) boolean mask, True where query i may attend key j: same document (and j <= i)."""
    keep = segments[:, :, None] == segments[:, None, :]
    if causal:
        L = segments.shape[1]
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    return keep[:, None]


def cu_seqlens(segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Packed documents of (B, L) ``segments`` as a varlen kernel takes them: int32 cumulative lengths
    over the flattened batch (documents never span rows) and the longest document.

    Finding the documents needs the host (their number and the longest one size the kernel's grid), so
    the answer is kept on the ``segments`` tensor: the model makes it once per forward and every layer,
    and an activation-checkpointing recompute, reuse it (one host sync per micro-batch, not per layer)."""
    cached = getattr(segments, "_goat_cu_seqlens", None)
    if cached is not None:
        return cached
    B, L = segments.shape
    flat = (segments + torch.arange(B, device=segments.device)[:, None] * (L + 1)).flatten()
    starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    segments._goat_cu_seqlens = (cu, int(torch.diff(cu).max()))
    return segments._goat_cu_seqlens


def alibi_bias(
    slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """ALiBi's additive bias ``-slope_h * (t_i - t_j)``, fp32, for query positions (B, Lq) and key
    positions (B, Lk) (default: the queries'; either may be (Lq,) / (Lk,) for every row): (B, H, Lq, Lk)
    (only its causal part matters)."""
    key_positions = query_positions if key_positions is None else key_positions
    distance = query_positions.float()[..., :, None] - key_positions.float()[..., None, :]  # (B, Lq, Lk)
    return -slopes.to(distance.device)[None, :, None, None] * distance[..., None, :, :]
