"""The position schemes (``model.position``), one object each, used by every attention path: the
normal one (``model/attention.py``), context-parallel chunks (``parallel/context.py``) and cached
generation (``generation.py``).

Each reads absolute ``position_ids`` (B, L), so packed documents, offsets and context parallelism work
the same for every scheme. What a scheme gives the kernel call:

* ``fold(q, k, position_ids, origin)``: q and k with the positions applied: GOAT's prior lanes appended
  (``goat.fold_prior``), RoPE's rotation; the others return them as they are;
* ``scale``: the softmax scale (GOAT: ``1/sqrt(d_c)``, its lanes carry their own scales);
* ``slopes()`` and ``bias(query_positions, key_positions)``: ALiBi's slopes (for a kernel that
  computes ALiBi itself: flash-attn 2) and its additive bias; None for the other schemes;
* ``kernel_inputs(q, k, position_ids, backend=, origin=)``: ``(q, k, scale, kernel arguments)`` for one
  ``kernels.attend`` call, whatever the backend (GOAT on ``eager``: the explicit log-prior as a bias;
  ALiBi: slopes for flash-attn 2, else the bias; FlashAttention-4 refuses ALiBi).
"""

from __future__ import annotations

import torch
from torch import nn

from ..goat import GoatPrior, alibi_slopes, fold_prior, goat_kernel_inputs
from ..kernels import FLASH4_ALIBI_ERROR, alibi_bias
from ..shapes import key_bias_lanes


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


class Position(nn.Module):
    """No position information in attention (``none``; ``learned`` adds its table at the embedding).

    Schemes are modules (the attention layer registers its scheme as ``position``) so that what they
    hold moves and casts with the model; they own no parameters (GOAT's prior is the attention layer's
    ``prior``, see ``Goat``)."""

    name = "none"
    prior: GoatPrior | None = None

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.content_dim = head_dim  # q/k dims that carry content (GOAT takes lanes from them)
        self.scale = head_dim**-0.5

    def fold(self, q, k, position_ids, origin=None):
        return q, k

    def slopes(self) -> torch.Tensor | None:
        return None

    def bias(self, query_positions, key_positions=None) -> torch.Tensor | None:
        return None

    def kernel_inputs(self, q, k, position_ids, *, backend: str, origin=None):
        q, k = self.fold(q, k, position_ids, origin)
        return q, k, self.scale, {}


class Learned(Position):
    name = "learned"


class Rope(Position):
    name = "rope"

    def __init__(self, head_dim: int, base: float):
        super().__init__(head_dim)
        self.base = base

    def fold(self, q, k, position_ids, origin=None):
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Alibi(Position):
    """ALiBi (Press et al.): ``-slope_h * (t_i - t_j)`` added to the logits; ``head_slopes`` (H,) are
    this rank's heads' (a slice of ``goat.alibi_slopes`` over all heads)."""

    name = "alibi"

    def __init__(self, head_dim: int, head_slopes: torch.Tensor):
        super().__init__(head_dim)
        self.register_buffer("head_slopes", head_slopes, persistent=False)  # moves and casts with the model

    def slopes(self) -> torch.Tensor:
        """(H,), in the model's dtype (a kernel that computes ALiBi itself converts them)."""
        return self.head_slopes

    def bias(self, query_positions, key_positions=None) -> torch.Tensor:
        return alibi_bias(self.head_slopes, query_positions, key_positions)

    def kernel_inputs(self, q, k, position_ids, *, backend: str, origin=None):
        if backend == "flash4":  # FA4 has ALiBi only as a CuTe-DSL score_mod: not shipped
            raise ValueError(FLASH4_ALIBI_ERROR)
        if backend == "flash":  # flash-attn computes ALiBi itself, in fp32, from the slopes
            return (
                q,
                k,
                self.scale,
                {"alibi_slopes": self.head_slopes.to(device=q.device, dtype=torch.float32)},
            )
        return q, k, self.scale, {"bias": self.bias(position_ids)}


class Goat(Position):
    """GOAT: the learned prior (``prior``, this rank's KV heads) folded into q and k."""

    name = "goat"

    def __init__(self, head_dim: int, prior: GoatPrior):
        super().__init__(head_dim)
        # the attention layer registers the prior (its parameters are ``...attn.prior.*``); held here
        # unregistered, so the parameters are not listed twice
        object.__setattr__(self, "prior", prior)
        self.content_dim = head_dim - prior.num_lanes
        self.scale = self.content_dim**-0.5

    def fold(self, q, k, position_ids, origin=None):
        return fold_prior(q, k, self.prior, position_ids, causal=True, origin=origin)

    def kernel_inputs(self, q, k, position_ids, *, backend: str, origin=None):
        q, k, scale, bias = goat_kernel_inputs(
            q, k, self.prior, position_ids, causal=True, backend=backend, origin=origin
        )
        return q, k, scale, {} if bias is None else {"bias": bias}


def build_position(cfg, *, head_dim: int, tp: int = 1, tp_rank: int = 0) -> Position:
    """The scheme ``cfg.position`` (a ``ModelConfig``) for one TP rank's heads."""
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    if cfg.position == "goat":
        g, local_kv = cfg.goat, kv_heads // tp
        prior = GoatPrior(
            local_kv,
            g.pos_rank,
            g.abs_rank,
            pos_base=g.pos_base,
            abs_base=g.abs_base,
            key_bias=g.key_bias,
            training_seq_len=g.train_len or cfg.seq_len,
            prior_init=g.prior_init,
            init_scale=g.sink_init_std,
            head_offset=tp_rank * local_kv,
            total_kv_heads=kv_heads,
            key_lanes=key_bias_lanes(g),  # fixed by the config (q/k shapes depend on it), auto read as 3
        )
        return Goat(head_dim, prior)
    if cfg.position == "rope":
        return Rope(head_dim, cfg.rope_base)
    if cfg.position == "alibi":
        local = heads // tp
        return Alibi(head_dim, alibi_slopes(heads)[tp_rank * local : (tp_rank + 1) * local])
    return {"learned": Learned, "none": Position}[cfg.position](head_dim)
