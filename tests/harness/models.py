"""The tiny model of the tests that build a ``GPT`` in-process: two layers of width 64 (4 heads of 16)
over a 300-token vocabulary, built in well under a second on one CPU core."""

from __future__ import annotations

from goat_dist.config import ModelConfig

TINY_MODEL = {"vocab_size": 300, "num_layers": 2, "hidden_size": 64, "num_heads": 4}


def tiny_model_config(**fields) -> ModelConfig:
    """A ModelConfig of TINY_MODEL's size; ``fields`` (``seq_len``, ``num_kv_heads``, ``position``, ...) are
    added to it and win over it."""
    return ModelConfig(**{**TINY_MODEL, **fields})
