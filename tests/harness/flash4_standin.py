"""The FlashAttention-4 stand-in, now a product module (``goat_dist/kernels/flash4_standin.py``: the
rehearsal runs on it too), re-exported under its old test-side name."""

from goat_dist.kernels.flash4_standin import (
    Flash4Standin,
    KernelRefusal,
    backward_refusal,
    fa2_cute_interface,
    head_dims_supported,
    installed,
)

__all__ = [
    "Flash4Standin",
    "KernelRefusal",
    "backward_refusal",
    "fa2_cute_interface",
    "head_dims_supported",
    "installed",
]
