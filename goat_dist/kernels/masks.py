"""What kernels are told besides q, k and v: packed-document segments (dense masks and the varlen
kernels' cumulative lengths) and ALiBi's additive bias."""

from __future__ import annotations

import torch


def document_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Segment ids (B, L) of packed documents, from positions that restart (``t != t_prev + 1``);
    None when no row has a boundary, so unpacked batches keep the plain causal fast path.

    The documents are found on the host: one read of the positions per micro-batch (on a GPU, the one
    host sync packed documents cost: their number and the longest one size the varlen kernels' grids).
    The host copy of the segments travels with them (``HOST_COPY``), so ``cu_seqlens`` and context
    parallelism's chunk index (``chunks``) need no further read."""
    host = position_ids.cpu()
    starts = torch.ones_like(host, dtype=torch.bool)
    starts[:, 1:] = host[:, 1:] != host[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    on_host = starts.long().cumsum(dim=1)
    segments = on_host.to(position_ids.device, non_blocking=True)
    setattr(segments, HOST_COPY, on_host)
    return segments


HOST_COPY = "_goat_host_segments"  # the attribute of a device segments tensor that holds its host copy


def host_segments(segments: torch.Tensor) -> torch.Tensor:
    """``segments`` on the host: the copy ``document_segments`` kept, else read now."""
    kept = getattr(segments, HOST_COPY, None)
    return kept if kept is not None else segments.cpu()


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

    Finding the documents needs their values on the host (their number and the longest one size the
    kernel's grid): read from the host copy ``document_segments`` keeps (``host_segments``), computed
    there and sent to the device once; kept on the ``segments`` tensor, which every layer and an
    activation-checkpointing recompute reuse."""
    cached = getattr(segments, "_goat_cu_seqlens", None)
    if cached is not None:
        return cached
    host = host_segments(segments)
    B, L = host.shape
    flat = (host + torch.arange(B)[:, None] * (L + 1)).flatten()
    starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    longest = int(torch.diff(cu).max())
    segments._goat_cu_seqlens = (cu.to(segments.device, non_blocking=True), longest)
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
