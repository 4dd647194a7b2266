"""How the model runs in parallel: ``model_parallel.apply`` (sequence parallelism's scatter/gather, the
context-parallel split, activation checkpointing, set up on a built model), context parallelism itself
(``context.py``: the split of whole rows, the differentiable K/V gather, attention of the local chunks),
and ZeRO-3's partition arithmetic (``zero3.py``).

Imports: torch, megatron-core, ``goat_dist.kernels`` and ``goat_dist.goat``; never ``goat_dist.model``
(the model imports this package).
"""

from .context import (
    ContextParallel,
    ContextShard,
    attend_context,
    context_attention,
    context_parallel,
    context_shard,
    gather_sequence,
)

__all__ = [
    "ContextParallel",
    "ContextShard",
    "attend_context",
    "context_attention",
    "context_parallel",
    "context_shard",
    "gather_sequence",
]
