"""The GPT model: megatron-core tensor-parallel layers (``gpt.py``, ``attention.py``) with one object per
position scheme (``positions.py``: GOAT, RoPE, ALiBi, learned or none).

May import: torch, megatron-core's layers, ``goat_dist.config``, ``goat_dist.shapes``, ``goat_dist.data``
(the ignored label id), ``goat_dist.goat`` (the prior), ``goat_dist.kernels`` (the attention calls) and
``goat_dist.parallel`` (which sets up how the model runs in parallel). The forward reads no process state:
what it needs is set up at construction (``parallel.model_parallel.apply``).
"""

from .gpt import GPT, padded_vocab_size

__all__ = ["GPT", "padded_vocab_size"]
