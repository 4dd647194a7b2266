"""Sharded, atomically published checkpoints (DeepSpeed shards + run state + RNG + manifest)."""

from .manager import CheckpointError, CheckpointManager, tag_for, verify

__all__ = ["CheckpointError", "CheckpointManager", "tag_for", "verify"]
