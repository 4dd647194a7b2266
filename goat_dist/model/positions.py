"""Baseline position schemes compared against GOAT in the same model: RoPE and ALiBi.

Both read absolute ``position_ids`` (B, L), like GOAT, so packed documents, offsets and context
parallelism work the same for every scheme.
"""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, L, 1, head_dim) in fp32 for rotate-half RoPE (GPT-NeoX / Llama layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = position_ids.double()[..., None] * inv_freq.to(position_ids.device)  # (B, L, D/2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, L, H, D) by position; computed in fp32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def alibi_bias(position_ids: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """ALiBi's additive bias ``-slope_h * (t_i - t_j)``, (B, H, L, L) fp32 (causal part only matters)."""
    t = position_ids.float()
    distance = t[:, :, None] - t[:, None, :]  # (B, L, L)
    return -slopes.to(t.device)[None, :, None, None] * distance[:, None]
