"""The training precision: re-exported from ``goat_dist.precision``, where the policy is resolved for
training, evaluation, the MFU peak and the planner alike (the engine's bf16 mode is configured from the
same resolved value in ``parallelize.deepspeed_config``)."""

from __future__ import annotations

from ..precision import autocast_context, autocast_for, resolve_precision, torch_dtype

__all__ = ["autocast_context", "autocast_for", "resolve_precision", "torch_dtype"]
