"""How the model runs in parallel: ``model_parallel.apply`` (sequence parallelism's scatter/gather, the
context-parallel split, activation checkpointing, set up on a built model), context parallelism itself
(``context.py``: the split of whole rows, the differentiable K/V gather, attention of the local chunks),
``parallelize`` (the one step: the TP gradient sum, then the engine) and ``timeouts`` (the collective
timeout of every process group: ``parallel.startup_timeout_minutes`` until this process's first step ends,
then ``parallel.timeout_minutes``).

May import: torch, megatron-core, ``goat_dist.collectives``, ``goat_dist.config``, ``goat_dist.kernels``,
``goat_dist.goat``, ``goat_dist.optim`` and ``goat_dist.engine`` (``parallelize`` builds the engine last);
never ``goat_dist.model`` (the model imports this package).
"""

from .context import (
    ContextParallel,
    ContextShard,
    attend_context,
    context_attention,
    gather_sequence,
)

__all__ = [
    "ContextParallel",
    "ContextShard",
    "attend_context",
    "context_attention",
    "gather_sequence",
]
