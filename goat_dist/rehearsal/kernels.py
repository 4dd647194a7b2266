"""The attention kernels a GPU runs, stood in on the meta device: FlashAttention-4 on Hopper and Blackwell
(``kernels.fa4_dims.FLASH4_MAJORS``), FlashAttention-2 on Ampere, each applying its real interface's input
rules (``kernels.flash4_standin``, ``kernels.flash_standin``: the rules the CPU compile check holds against
the real kernels) and raising ``KernelRefusal`` for a call the real kernel refuses. ``auto`` then picks the
kernel it picks on that GPU with the GPU extra installed (FlashAttention-4; FlashAttention-2 is a separate
extra, so on Hopper ALiBi runs on SDPA)."""

from __future__ import annotations

import contextlib

from ..kernels.fa4_dims import FLASH4_MAJORS
from ..kernels.refusal import KernelRefusal

__all__ = ["KernelRefusal", "kernels_of"]


@contextlib.contextmanager
def kernels_of(capability: tuple[int, int] | None):
    """The stand-in kernel of a GPU of compute ``capability`` installed for the block (none without one)."""
    if capability is None:
        yield None
    elif capability[0] in FLASH4_MAJORS:
        from ..kernels import flash4_standin

        with flash4_standin.installed(capability=capability) as standin:
            yield standin
    elif capability[0] == 8:
        from ..kernels import flash_standin

        with flash_standin.installed(capability=capability) as standin:
            yield standin
    else:
        yield None
