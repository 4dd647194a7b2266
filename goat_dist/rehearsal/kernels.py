"""The attention kernels a GPU runs, stood in on the meta device: FlashAttention-4 on Hopper and Blackwell
(compute capability 9.x-12.x), FlashAttention-2 on Ampere, each applying its real interface's input rules
(``kernels.flash4_standin``, ``kernels.flash_standin``) and refusing what the real kernel refuses
(``KernelRefusal``)."""

from __future__ import annotations

import contextlib


class KernelRefusal(ValueError):
    """Placeholder until the stand-ins land."""


@contextlib.contextmanager
def kernels_of(capability):
    yield
