"""Parallelism that spans the sequence: context parallelism (``context.py``)."""

from .context import ContextShard, context_attention, context_shard, gather_sequence

__all__ = ["ContextShard", "context_attention", "context_shard", "gather_sequence"]
