"""The GOAT attention prior: learned log-prior K_ij = K_rel(t_i - t_j) + u(t_j).

Parameters live per KV head (GQA groups share their KV head's prior). The module produces the prior in
two equivalent forms:

* ``lanes``: query and key lanes whose dot product, times the kernel's softmax scale, equals ``K_ij``
  up to a per-row constant, so one unmodified attention kernel computes content + prior with no L x L
  bias tensor. ``2R`` spectral lanes carry K_rel; ``key_lanes`` lanes carry the per-key value u(j)
  split into parts the kernel's dtype holds exactly (see ``exact.py``): 3 for bf16/fp16 (``2R + 3``
  lanes), 1 where the kernel computes in fp32 (``2R + 1``, the reference's count: the other parts would
  be identically zero), ``2R`` without the sink;
* ``log_prior``: the explicit ``(B, H_kv, L, L)`` matrix, for the eager reference kernel and for plots.

Numerics follow the reference (``goat-attention`` 0.1.1) feature by feature, with deliberate changes
for low precision and long sequences:

* the causal recency term ``slope * t_j`` is stored as ``slope * (t_j - origin)``, ``origin`` the
  middle of the sequence's positions (``sequence_origin``; softmax ignores the per-row constant), so it
  is bounded by ``slope * L / 2`` at any absolute offset instead of growing with the position;
* u(j), recency included, reaches a 16-bit kernel as 3 exactly-representable parts with an exact query side,
  so bf16 and fp16 kernels see it to 2^-27 of its size instead of a staircase of bf16 steps (one bf16
  lane is off by several logits inside one 16k sequence);
* Fourier phases are formed in fp64 from the global positions, so the spectral lanes are bounded values
  (cos/sin) that are exact at any offset; their only low-precision error is one rounding of
  ``lambda * cos`` on the query side and of ``cos`` on the key side, independent of position and length.

Every lane is a function of the global position and of one per-sequence constant (the origin), so a
context-parallel rank can build the lanes of its own chunk (given the row's origin).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..shapes import KEY_BIAS_LANES, prior_lane_count
from .exact import LANE_QUERY, SPLIT_PARTS, sequence_origin, split_exact

__all__ = [
    "FP32_FORWARD",
    "GoatPrior",
    "SinkMLP",
    "alibi_slopes",
    "forward_value",
    "fourier_features",
    "geometric_frequencies",
    "inverse_softplus",
    "prior_lane_count",
]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al.), including the non-power-of-two interleaving rule."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    # Plain floats throughout: no tensor round trip, so this works under a meta-device default too.
    if math.log2(n_heads).is_integer():
        slopes = power_of_2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


assert KEY_BIAS_LANES == SPLIT_PARTS  # the shape arithmetic counts u(j)'s lanes as split_exact makes them


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.expm1(y.clamp(min=1e-6)))


def geometric_frequencies(rank: int, base: float) -> torch.Tensor:
    """``base ** (-r / (rank - 1))`` for r = 0..rank-1, in fp32 exactly as the reference computes it."""
    idx = torch.arange(rank, dtype=torch.float32)
    return base ** (-idx / max(rank - 1, 1))


def fourier_features(
    t: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[cos(w t), sin(w t)]`` in ``dtype`` along a new last dim, for integer positions ``t`` of any shape.

    Phases are formed in fp64: in fp32, ``w * t`` at t = 1e5 is already off by ~4e-3 rad. The cost is
    O(L * R), nothing next to attention.
    """
    phases = t.double()[..., None] * freqs.double()
    return torch.cat([torch.cos(phases), torch.sin(phases)], dim=-1).to(dtype)


FP32_FORWARD = "fp32_forward"  # attribute a training engine may attach to a prior parameter


def forward_value(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A prior parameter's value in ``dtype``, carrying ``p``'s gradient.

    Where the training engine keeps the parameter itself in bf16 and its exact fp32 value elsewhere
    (ZeRO-3, whose partitions all live in one buffer of one dtype; ``engine/zero3.py``), it
    attaches that value as ``p.fp32_forward``: the prior then computes from it exactly, as under ZeRO 0-2,
    and the gradient still flows to ``p`` (``value + (exact - value).detach()``; the difference between
    an fp32 number and its bf16 rounding is exact in fp32, so the sum is the fp32 value to the bit)."""
    value = p.to(dtype)
    exact = getattr(p, FP32_FORWARD, None)
    if exact is None:
        return value
    return value + (exact.to(dtype) - value).detach()


class SinkMLP(nn.Module):
    """Tiny MLP over absolute-position features: the sink part of u(j), shared by the heads."""

    def __init__(self, in_dim: int, hidden: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In ``x``'s dtype (fp32 features) whatever the parameters' (see ``forward_value``)."""
        dt = x.dtype
        h = F.silu(F.linear(x, forward_value(self.fc1.weight, dt), forward_value(self.fc1.bias, dt)))
        return F.linear(h, forward_value(self.fc2.weight, dt), forward_value(self.fc2.bias, dt)).squeeze(-1)


class GoatPrior(nn.Module):
    """Per-KV-head GOAT prior parameters and their lane / matrix forms.

    ``num_kv_heads`` are the heads this module owns (under tensor parallelism: this rank's slice);
    ``head_offset`` and ``total_kv_heads`` place them among all heads so that ALiBi-seeded slopes are the
    global heads' slopes. Parameters are kept in fp32 whatever dtype the surrounding model is cast to.
    """

    def __init__(
        self,
        num_kv_heads: int,
        pos_rank: int = 4,
        abs_rank: int = 4,
        pos_base: float = 10_000.0,
        abs_base: float = 10_000.0,
        key_bias: bool = True,
        training_seq_len: int = 2048,
        prior_init: str = "seeded",
        init_scale: float = 1e-3,
        head_offset: int = 0,
        total_kv_heads: int | None = None,
        key_lanes: int | None = SPLIT_PARTS,
    ):
        """``init_scale``: std of the sink MLP's initial weights (``model.goat.sink_init_std``).
        ``key_lanes``: u(j)'s lanes, 1 to ``SPLIT_PARTS``; None: as many as the kernel's dtype needs
        (1 in fp32/fp64, ``SPLIT_PARTS`` in bf16/fp16), for a standalone layer whose q/k width may
        follow the dtype (``from_reference``); a model with fixed q/k shapes gives a number."""
        super().__init__()
        if key_lanes is not None and not 1 <= key_lanes <= SPLIT_PARTS:
            raise ValueError(f"key_lanes must be 1..{SPLIT_PARTS} or None, got {key_lanes}")
        if pos_rank < 0 or abs_rank < 0:
            raise ValueError(f"pos_rank and abs_rank must be >= 0, got {pos_rank}, {abs_rank}")
        if prior_init not in ("seeded", "uniform"):
            raise ValueError(f"prior_init must be 'seeded' or 'uniform', got {prior_init!r}")
        if training_seq_len < 1:
            raise ValueError(f"training_seq_len must be >= 1, got {training_seq_len}")
        self.num_kv_heads = num_kv_heads
        self.pos_rank = pos_rank
        self.abs_rank = abs_rank
        self.key_bias = key_bias
        self.training_seq_len = training_seq_len
        self.prior_init = prior_init
        self.init_scale = init_scale
        self.head_offset = head_offset
        self.total_kv_heads = total_kv_heads or num_kv_heads
        self.key_lanes = key_lanes
        # the widest the lanes get (the 16-bit count when key_lanes is None): what q/k must make room for
        self.num_lanes = prior_lane_count(pos_rank, key_bias, key_lanes or SPLIT_PARTS)

        self.register_buffer("rel_freqs", geometric_frequencies(pos_rank, pos_base), persistent=False)
        self.register_buffer("abs_freqs", geometric_frequencies(abs_rank, abs_base), persistent=False)
        if pos_rank > 0:  # pos_rank 0: no K_rel, and no empty parameters for checkpoints to hold
            self.lambda_sym = nn.Parameter(torch.empty(num_kv_heads, pos_rank))
            self.lambda_asym = nn.Parameter(torch.empty(num_kv_heads, pos_rank))
        if key_bias:
            # abs_rank 0: no sink MLP (and no gain to scale it); u(j) keeps the token-0 bump and the recency
            self.sink_mlp = SinkMLP(2 * abs_rank + 2) if abs_rank > 0 else None
            if abs_rank > 0:
                self.sink_gain = nn.Parameter(torch.empty(num_kv_heads))
            self.sink_bump = nn.Parameter(torch.empty(num_kv_heads))
            self.recency_slope_raw = nn.Parameter(torch.empty(num_kv_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        seeded = self.prior_init == "seeded"
        heads = slice(self.head_offset, self.head_offset + self.num_kv_heads)
        if self.pos_rank > 0:
            nn.init.zeros_(self.lambda_asym)
            if seeded:  # drawn for all heads, then sliced: the same weights (and RNG use) for any TP size
                self.lambda_sym.copy_(torch.randn(self.total_kv_heads, self.pos_rank)[heads] * 1e-2)
            else:
                nn.init.zeros_(self.lambda_sym)
        if not self.key_bias:
            return
        if self.sink_mlp is not None:
            for layer in (self.sink_mlp.fc1, self.sink_mlp.fc2):
                nn.init.normal_(layer.weight, std=self.init_scale)
                nn.init.zeros_(layer.bias)
            self.sink_gain.fill_(1.0)
            if not seeded:
                self.sink_mlp.fc2.weight.zero_()
        self.sink_bump.zero_()
        if seeded:
            slopes = alibi_slopes(self.total_kv_heads)[heads]
            self.recency_slope_raw.copy_(inverse_softplus(slopes))
        else:
            self.recency_slope_raw.fill_(-30.0)

    def _apply(self, fn, recurse=True):
        # Keep the prior in at least fp32 when the model is cast (model.to(bfloat16)): its lanes are
        # computed in the parameters' dtype and rounded once, at the end; rounding the parameters
        # themselves would lose the small lambda values and the recency slopes. A cast to float64 is
        # followed (a float64 module is the reference the bf16 error is measured against).
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t.dtype == torch.float32 and out.is_floating_point() and out.element_size() < 4:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, recurse)

    @property
    def compute_dtype(self) -> torch.dtype:
        """fp32, or fp64 for a module cast to float64: lanes and log-prior are formed in this dtype, from
        parameters upcast to it (``forward_value``)."""
        return self.rel_freqs.dtype if self.rel_freqs.dtype == torch.float64 else torch.float32

    # ---- per-key value u(j) ------------------------------------------------------------------------
    def sink(
        self, position_ids: torch.Tensor, causal: bool, origin: torch.Tensor | None = None
    ) -> torch.Tensor:
        """u_h(t_j) for integer positions (B, L), up to a per-row constant: returns (B, L, H_kv).

        ``origin`` (B, 1): the per-sequence constant the recency is measured from (default
        ``sequence_origin(position_ids)``; under context parallelism, the whole row's).
        """
        dtype = self.compute_dtype
        bump, slope_raw = (forward_value(p, dtype) for p in (self.sink_bump, self.recency_slope_raw))
        u = bump * (position_ids == 0)[..., None]
        if self.sink_mlp is not None:
            u = u + forward_value(self.sink_gain, dtype) * self._sink_mlp(position_ids)[..., None]
        if causal:
            # slope * t_j equals ALiBi's -slope * (i - j) up to a row constant; measured from the middle
            # of the sequence's positions it stays small (|.| <= slope * L / 2) at any absolute offset.
            # Integer origin keeps (t - origin) exact.
            origin = sequence_origin(position_ids) if origin is None else origin
            u = u + F.softplus(slope_raw) * (position_ids - origin).to(dtype)[..., None]
        return u

    def _sink_mlp(self, position_ids: torch.Tensor) -> torch.Tensor:
        """MLP(phi(t_j)), (B, L), from the absolute features; kept fp32 under bf16 autocast."""
        dtype = self.compute_dtype
        t = position_ids.to(dtype)
        denom = float(self.training_seq_len)
        feats = torch.cat(
            [
                fourier_features(position_ids, self.abs_freqs, dtype),
                (t / denom)[..., None],
                (torch.log1p(t) / math.log1p(denom))[..., None],
            ],
            dim=-1,
        )
        with torch.autocast(position_ids.device.type, enabled=False):
            return self.sink_mlp(feats)

    # ---- folded form -------------------------------------------------------------------------------
    def key_parts(self, dtype: torch.dtype) -> int:
        """u(j)'s lanes for a kernel of ``dtype`` (0 without the sink): ``key_lanes``, or with None
        1 for fp32/fp64 (one lane holds u(j) to the kernel's own precision) and ``SPLIT_PARTS`` below."""
        if not self.key_bias:
            return 0
        if self.key_lanes is not None:
            return self.key_lanes
        return 1 if dtype.itemsize >= 4 else SPLIT_PARTS

    def lane_count(self, dtype: torch.dtype) -> int:
        """Lanes ``lanes(..., dtype=dtype)`` returns: ``num_lanes`` unless ``key_lanes`` is None."""
        return 2 * self.pos_rank + self.key_parts(dtype)

    def lanes(
        self,
        position_ids: torch.Tensor,
        causal: bool,
        *,
        scale: float,
        dtype: torch.dtype = torch.float32,
        origin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key lanes, each (B, L, H_kv, num_lanes) in ``dtype``, with
        ``scale * (q_lanes . k_lanes) = K_ij + c_i`` when the kernel rounds nothing beyond ``dtype``.

        ``scale`` is the softmax scale the kernel applies to every lane (GOAT's ``1/sqrt(d_c)``): the
        lanes carry its inverse. Spectral lanes: query ``(a cos + b sin) / scale`` (one rounding of a
        per-head coefficient times a bounded value), key ``cos(w t_j)`` from global positions. Per-key
        lanes: query ``LANE_QUERY`` (exact), key ``u_j / (scale * LANE_QUERY)`` split into
        ``key_parts(dtype)`` parts exact in ``dtype`` (``split_exact``); with one part in a 16-bit dtype
        (a ``key_lanes=1`` model run in bf16) u(j) is rounded once, as the reference rounds it.
        """
        B, L = position_ids.shape
        H, R = self.num_kv_heads, self.pos_rank
        cdt = self.compute_dtype
        q_parts, k_parts = [], []
        if R > 0:
            feats = fourier_features(position_ids, self.rel_freqs, cdt)[..., None, :]  # (B, L, 1, 2R)
            cos, sin = feats.split(R, dim=-1)
            a = forward_value(self.lambda_sym, cdt) / scale  # (H, R)
            b = forward_value(self.lambda_asym, cdt) / scale
            q_parts += [a * cos + b * sin, a * sin - b * cos]
            k_parts += [cos.expand(B, L, H, R), sin.expand(B, L, H, R)]
        if self.key_bias:
            parts = self.key_parts(dtype)
            u = self.sink(position_ids, causal, origin) / (scale * LANE_QUERY)
            q_parts.append(torch.full((B, L, H, parts), LANE_QUERY, dtype=cdt, device=u.device))
            k_parts.append(split_exact(u, dtype, parts))
        if not q_parts:
            empty = torch.zeros(B, L, H, 0, dtype=dtype, device=position_ids.device)
            return empty, empty
        return torch.cat(q_parts, dim=-1).to(dtype), torch.cat(k_parts, dim=-1).to(dtype)

    # ---- explicit form -----------------------------------------------------------------------------
    def log_prior(
        self, position_ids: torch.Tensor, causal: bool, origin: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The explicit log-prior K_ij, (B, H_kv, L, L) in ``compute_dtype``, straight from the formula."""
        dtype = self.compute_dtype
        B, L = position_ids.shape
        K = torch.zeros(B, self.num_kv_heads, L, L, dtype=dtype, device=position_ids.device)
        if self.pos_rank > 0:
            delta = (position_ids[:, :, None] - position_ids[:, None, :]).double()  # (B, L, L)
            phases = delta[:, None, :, :, None] * self.rel_freqs.double()  # (B, 1, L, L, R)
            a = forward_value(self.lambda_sym, dtype)[None, :, None, None, :]
            b = forward_value(self.lambda_asym, dtype)[None, :, None, None, :]
            K = K + (a * torch.cos(phases).to(dtype) + b * torch.sin(phases).to(dtype)).sum(-1)
        if self.key_bias:
            K = K + self.sink(position_ids, causal, origin).permute(0, 2, 1)[:, :, None, :]
        return K

    def extra_repr(self) -> str:
        return (
            f"kv_heads={self.num_kv_heads}, R={self.pos_rank}, M={self.abs_rank}, key_bias={self.key_bias}, "
            f"key_lanes={self.key_lanes or 'by dtype'}, L_train={self.training_seq_len}, "
            f"init={self.prior_init}"
        )
