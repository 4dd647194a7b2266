"""Which attention kernel runs: ``resolve_backend`` maps a configured name (``auto`` included) to one
that imports and supports the GPU, given that GPU's compute capability.

The capability is an argument (``capability=``): a tuple ``(major, minor)``, None for no CUDA, or the
default ``DEVICE``, which asks torch.cuda about the current device (``device_capability``).
"""

from __future__ import annotations

import torch

from ..config import ATTENTION_BACKENDS as BACKENDS
from . import flash_imports
from .fa4_dims import FLASH4_MAJORS, flash4_head_dims
from .flash_imports import notice_auto_fallback

DEVICE = "device"  # capability=DEVICE: ask torch.cuda (``device_capability``)

FLASH4_ALIBI_ERROR = (
    "model.position=alibi does not run on model.attention_backend=flash4: FlashAttention-4 offers ALiBi "
    "only as a CuTe-DSL score_mod with a matching score_mod_bwd, which goat-dist does not ship. Use "
    "model.attention_backend=flash (FlashAttention-2 computes ALiBi from its slopes; "
    "pip install 'goat-dist[flash2]') or sdpa"
)


def device_capability(device=None) -> tuple[int, int] | None:
    """CUDA compute capability (major, minor) of ``device`` (default: the current one); None without
    CUDA. What ``capability=DEVICE`` means everywhere in this package."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def _capability(capability, device=None):
    return device_capability(device) if capability is DEVICE else capability


def flash_available(capability=DEVICE) -> bool:
    """flash-attn 2 imports and the GPU is Ampere or newer (its kernels start at compute capability 8.0)."""
    cap = _capability(capability)
    return cap is not None and cap[0] >= 8 and flash_imports._flash_attn() is not None


def flash4_available(capability=DEVICE) -> bool:
    """FlashAttention-4 imports and trains on this GPU generation (``FLASH4_MAJORS``)."""
    cap = _capability(capability)
    return cap is not None and cap[0] in FLASH4_MAJORS and flash_imports._flash_attn_cute() is not None


def resolve_backend(
    name: str, *, position: str | None = None, head_dim: int | None = None, capability=DEVICE
) -> str:
    """Map ``auto`` to the fastest usable kernel; reject unknown or unavailable ones clearly.

    ``auto``: flash4 when ``flash_attn.cute`` imports and the GPU's compute capability is 9.x-12.x,
    else flash-attn 2 when it imports on CUDA, else sdpa. Given the model's ``position`` scheme and
    ``head_dim``, ``auto`` also passes over flash4 for ALiBi and for a head dim FA4 does not take on
    this GPU, and an explicit ``flash4`` says so at once. ``capability``: the GPU's (major, minor),
    None for no CUDA; by default the current device's.
    """
    if name not in BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {BACKENDS}, got {name!r}")
    cap = _capability(capability)
    if name == "auto":
        if flash4_available(cap) and _flash4_fits(position, head_dim, cap):
            return "flash4"
        choice = "flash" if flash_available(cap) else "sdpa"
        if cap is not None and cap[0] in FLASH4_MAJORS and flash_imports._flash_attn_cute() is None:
            why = flash_imports.flash4_unusable()
            notice_auto_fallback(choice, why)  # on a GPU FA4 would serve: say why it does not, once
        return choice
    if name == "flash4":
        if cap is None:
            why = "CUDA is not available"
        elif cap[0] not in FLASH4_MAJORS:
            why = (
                f"this GPU has compute capability {cap[0]}.{cap[1]} and FlashAttention-4 trains only on "
                "9.x-12.x (Hopper, Blackwell); use attention_backend=flash (FlashAttention-2, "
                "pip install 'goat-dist[flash2]') on it"
            )
        elif flash_imports._flash_attn_cute() is None:
            why = flash_imports.flash4_unusable()
        else:
            if position == "alibi":
                raise ValueError(FLASH4_ALIBI_ERROR)
            if head_dim is not None:
                flash4_head_dims(head_dim, head_dim, cap[0])
            return name
        raise RuntimeError(
            f"model.attention_backend=flash4 was requested but {why}; install the GPU extra "
            "(pip install 'goat-dist[gpu]') on a Hopper or Blackwell machine, or use attention_backend=sdpa"
        )
    if name == "flash" and not flash_available(cap):
        why = "CUDA is not available" if cap is None else "flash-attn does not import"
        raise RuntimeError(
            f"model.attention_backend=flash was requested but {why}; install flash-attn 2 "
            "(pip install 'goat-dist[flash2]', a CUDA build) on a CUDA machine, or use "
            "attention_backend=flash4 or sdpa"
        )
    return name


def _flash4_fits(position: str | None, head_dim: int | None, cap: tuple[int, int]) -> bool:
    if position == "alibi":
        return False
    if head_dim is None:
        return True
    try:
        flash4_head_dims(head_dim, head_dim, cap[0])
    except ValueError:
        return False
    return True
