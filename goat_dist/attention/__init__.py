"""GOAT attention: learned attention priors folded into one attention kernel call."""

from .goat import goat_attention, split_grouped_qkv
from .kernels import BACKENDS, attend, flash_available, resolve_backend
from .module import GoatSelfAttention
from .prior import GoatPrior, alibi_slopes
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
    "resolve_backend",
    "split_grouped_qkv",
]
