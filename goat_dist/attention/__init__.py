"""GOAT attention: learned attention priors folded into one attention kernel call."""

from .exact import sequence_origin, split_exact
from .goat import goat_attention, split_grouped_qkv
from .kernels import BACKENDS, attend, flash_available, resolve_backend
from .module import GoatSelfAttention
from .prior import GoatPrior, alibi_slopes, prior_lane_count
from .reference import from_reference

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
