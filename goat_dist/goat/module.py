"""``goat_attention`` (content + prior in one kernel call) and ``GoatSelfAttention``: a standalone,
batch-first GOAT self-attention layer.

A drop-in for users of the reference ``goat.attention.GoatAttention`` (see ``from_reference``), built on
the same prior and kernels as the distributed model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import attend, resolve_backend
from .fold import goat_kernel_inputs, grouped_qkv_width, split_grouped_qkv
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

    ``eager`` adds the explicit log-prior matrix; the other backends append ``prior.lane_count(dtype)`` lanes
    to q and k, so one unmodified kernel call computes content + prior with no bias tensor. The lanes are
    built for the kernel's input dtype (q's), exact in bf16/fp16 up to one rounding of per-head spectral
    coefficients. The prior is not divided by the temperature: the kernel's scale is ``1/sqrt(d_c)`` and the
    lanes carry ``sqrt(d_c)``. Usually ``d_c + num_lanes == D_v`` (flash-attn 2 wants equal head dims); a
    module converted from the reference keeps the reference's ``d_c`` and has q/k two lanes wider in bf16.
    """
    q, k, scale, bias = goat_kernel_inputs(
        q_content, k_content, prior, position_ids, causal=causal, backend=backend, origin=origin
    )
    return attend(q, k, v, causal=causal, scale=scale, backend=backend, segments=segments, bias=bias)


class GoatSelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention with a learned GOAT prior.

    ``embed_dim / num_heads`` is the head dim D. By default the prior's lanes (``2*pos_rank + key_lanes``
    with the key bias, see ``GoatPrior``) are taken out of D and the rest (``content_dim``) carry q/k
    content, so q, k and v share one head dim (what flash-attn 2 needs). ``key_lanes``: 3 (default) keeps
    u(j) exact in bf16/fp16, 1 suffices in fp32, None follows the kernel dtype (1 in fp32, 3 below).
    ``content_dim`` can be set instead, q/k then being ``content_dim + lanes`` wide: ``from_reference``
    keeps the reference's ``D - 2R - 1`` content dims with ``key_lanes=None``, so q/k are D wide in fp32
    (the reference's layout, no padding lanes) and D + 2 in bf16. Values keep all D lanes.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kv_heads: int | None = None,
        pos_rank: int = 4,
        abs_rank: int = 4,
        *,
        pos_base: float = 10_000.0,
        abs_base: float = 10_000.0,
        key_bias: bool = True,
        training_seq_len: int = 2048,
        prior_init: str = "seeded",
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        content_dim: int | None = None,
        key_lanes: int | None = 3,
    ):
        super().__init__()
        kv_heads = kv_heads or num_heads
        if embed_dim % num_heads or num_heads % kv_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must divide by num_heads ({num_heads}) and num_heads by "
                f"kv_heads ({kv_heads})"
            )
        if dropout:
            raise NotImplementedError("attention dropout is not supported; GOAT pretraining uses none")
        self.embed_dim, self.num_heads, self.kv_heads = embed_dim, num_heads, kv_heads
        self.group = num_heads // kv_heads
        self.head_dim = embed_dim // num_heads
        self.prior = GoatPrior(
            kv_heads,
            pos_rank,
            abs_rank,
            pos_base=pos_base,
            abs_base=abs_base,
            key_bias=key_bias,
            training_seq_len=training_seq_len,
            prior_init=prior_init,
            key_lanes=key_lanes,
        )
        self.content_dim = self.head_dim - self.prior.num_lanes if content_dim is None else content_dim
        if self.content_dim < 1:
            raise ValueError(
                f"head_dim {self.head_dim} leaves no content lanes after {self.prior.num_lanes} prior "
                "lanes; lower pos_rank or raise embed_dim/num_heads"
            )
        qk_dim = self.content_dim + self.prior.num_lanes
        self.backend = resolve_backend(backend, position="goat", head_dim=qk_dim)
        width = grouped_qkv_width(kv_heads, self.group, self.content_dim, self.head_dim)
        self.qkv = nn.Linear(embed_dim, width, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        causal: bool = True,
        origin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) -> (B, L, E). ``position_ids`` (B, L) or (L,), default ``0..L-1``; ``origin``
        (B, 1), see ``goat_attention``."""
        B, L, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=x.device)
        position_ids = position_ids.expand(B, L)
        q, k, v = split_grouped_qkv(self.qkv(x), self.kv_heads, self.group, self.content_dim, self.head_dim)
        out = goat_attention(
            q, k, v, self.prior, position_ids, causal=causal, backend=self.backend, origin=origin
        )
        return self.out_proj(out.reshape(B, L, self.embed_dim))
