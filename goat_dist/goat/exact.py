"""Exact low-precision lanes: how the prior's per-key values survive bf16/fp16 kernel inputs.

An attention kernel rounds q and k to its input dtype and accumulates ``q . k`` in fp32 (flash-attn,
cuDNN and torch's SDPA kernels all do). A bf16 lane keeps 8 significant bits, so a per-key value stored
in one lane is off by up to ``2^-9`` of its magnitude; the causal recency value ``slope * (t_j - t0)``
reaches ``slope * L / 2`` and a single lane turns it into a staircase several logits high at L = 16k.

Instead a per-key value ``x`` is stored as ``parts`` lanes ``x_1 + x_2 + ... `` where ``x_1`` is ``x``
rounded to the kernel dtype and each next part is the remainder rounded again (``split_exact``). Each
remainder is exact in fp32 (Sterbenz), so ``parts`` lanes carry ``x`` to ``2^-(9 * parts)`` of its
magnitude in bf16 (``2^-(12 * parts)`` in fp16): with 3 parts, finer than fp32 itself. The query side of
these lanes is the power of two ``LANE_QUERY``, exact in every dtype, so the products are exact in the
fp32 accumulator and ``sum_p LANE_QUERY * x_p = LANE_QUERY * x`` up to fp32 rounding. ``LANE_QUERY``
(rather than 1) keeps ``x / LANE_QUERY`` inside fp16's range (65504) for sequences into the millions.

The values themselves must not grow with the absolute position: the recency value is measured from a
per-sequence origin (``sequence_origin``), so it is bounded by ``slope * L / 2`` at any offset.
"""

from __future__ import annotations

import torch

SPLIT_PARTS = 3  # lanes per per-key value: 2^-27 relative in bf16, below fp32's own 2^-24
LANE_QUERY = 256.0  # the query side of split lanes: a power of two, exact in bf16, fp16 and fp32


def split_exact(x: torch.Tensor, dtype: torch.dtype, parts: int = SPLIT_PARTS) -> torch.Tensor:
    """``x`` (any shape, fp32/fp64) as ``parts`` values along a new last dim, each exact in ``dtype``,
    summing to ``x`` up to the last part's rounding.

    Gradients: d(sum of parts)/dx = 1, carried by the first part (the others are constants): the kernel
    sees the same coefficient on every part, so the gradient of ``x`` is exactly the lane gradient.
    """
    pieces = []
    with torch.no_grad():
        rest = x.detach()
        for _ in range(parts):
            piece = rest.to(dtype).to(x.dtype)
            pieces.append(piece)
            rest = rest - piece  # exact: piece is rest rounded, within a factor 2 of it (Sterbenz)
    pieces[0] = pieces[0] + (x - x.detach())  # value unchanged (adds an exact 0), gradient 1
    return torch.stack(pieces, dim=-1)


def sequence_origin(position_ids: torch.Tensor) -> torch.Tensor:
    """The per-sequence origin (B, 1) of the recency value: the middle of the row's positions, floored.

    Any per-row constant leaves softmax unchanged; the middle one keeps ``|t_j - origin| <= span / 2``,
    whatever the absolute offset. Context parallelism: a rank that sees only chunks of a row must use the
    origin of the whole row (compute it before splitting the batch and pass it down as ``origin=``);
    with megatron's load-balanced split (rank r keeps chunks r and 2·CP−1−r) of contiguous positions the
    chunks' own min + max is the row's, so the default already agrees across ranks, but that is a
    coincidence of the split, not a contract.
    """
    lo = position_ids.amin(dim=-1, keepdim=True)
    hi = position_ids.amax(dim=-1, keepdim=True)
    return torch.div(lo + hi, 2, rounding_mode="floor")
