"""The GOAT maths: a learned attention prior folded into q and k, so one unmodified kernel call
computes content + prior.

Files: ``prior`` (``GoatPrior``: the per-head parameters, their query/key lanes and the explicit
log-prior; ALiBi's slopes, which seed the recency), ``exact`` (per-key values carried exactly through
bf16/fp16 lanes; the per-sequence recency origin), ``fold`` (the lanes appended to q/k, the grouped
fused q/k/v layout), ``module`` (``goat_attention`` and the standalone layer ``GoatSelfAttention``),
``reference`` (``from_reference``: the authors' ``goat.attention.GoatAttention`` converted).

May import: torch and ``goat_dist.shapes`` (torch-free shape arithmetic: lane count, fused q/k/v width);
``goat_dist.kernels`` for the standalone layer's kernel call (``module``) only.
"""

from .exact import LANE_QUERY, SPLIT_PARTS, sequence_origin, split_exact
from .fold import fold_prior, goat_kernel_inputs, grouped_qkv_width, split_grouped_qkv
from .module import GoatSelfAttention, goat_attention
from .prior import FP32_FORWARD, GoatPrior, alibi_slopes, prior_lane_count
from .reference import from_reference

__all__ = [
    "FP32_FORWARD",
    "LANE_QUERY",
    "SPLIT_PARTS",
    "GoatPrior",
    "GoatSelfAttention",
    "alibi_slopes",
    "fold_prior",
    "from_reference",
    "goat_attention",
    "goat_kernel_inputs",
    "grouped_qkv_width",
    "prior_lane_count",
    "sequence_origin",
    "split_exact",
    "split_grouped_qkv",
]
