"""Sharded, atomically published checkpoints: one copy of the state, each rank writing its own share
(``universal.py``), + run state + RNG + manifest.

Exports resolve lazily, so that the command line can register ``goat-dist ckpt`` without importing
torch, megatron or DeepSpeed (``goat-dist data`` never needs them).

May import: torch, safetensors, ``goat_dist.atomic``, ``goat_dist.collectives``, ``goat_dist.config``,
``goat_dist.shapes``, ``goat_dist.optim`` (which parameters are the prior's), ``goat_dist.engine`` (the fp32
masters and step counters) and, for exports, ``goat_dist.generation`` and ``goat_dist.inference``; never the
trainer (it builds on this package).
"""

from .errors import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "tag_for", "verify"]


def __getattr__(name: str):
    if name in ("CheckpointManager", "tag_for", "verify"):
        from . import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
