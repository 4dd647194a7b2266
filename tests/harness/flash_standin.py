"""The flash-attn 2 stand-in, now a product module (``goat_dist/kernels/flash_standin.py``: the
rehearsal runs on it too), re-exported under its old test-side name."""

from goat_dist.kernels.flash_standin import (
    FlashStandin,
    KernelRefusal,
    installed,
    loadable_16_bytes_at_a_time,
)

__all__ = ["FlashStandin", "KernelRefusal", "installed", "loadable_16_bytes_at_a_time"]
