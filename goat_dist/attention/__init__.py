"""Re-exports of the former ``goat_dist.attention`` package, for code that still imports it
(``observe/attention_stats.py``: ``split_grouped_qkv``; ``plan/dry_run.py``: ``attention.prior``). The
GOAT maths is ``goat_dist.goat``, the kernel calls are ``goat_dist.kernels``; new code imports those."""

from ..goat import (
    GoatPrior,
    GoatSelfAttention,
    alibi_slopes,
    from_reference,
    goat_attention,
    prior_lane_count,
    sequence_origin,
    split_exact,
    split_grouped_qkv,
)
from ..kernels import BACKENDS, attend, flash_available, resolve_backend

__all__ = [
    "BACKENDS",
    "GoatPrior",
    "GoatSelfAttention",
    "alibi_slopes",
    "attend",
    "flash_available",
    "from_reference",
    "goat_attention",
    "prior_lane_count",
    "resolve_backend",
    "sequence_origin",
    "split_exact",
    "split_grouped_qkv",
]
