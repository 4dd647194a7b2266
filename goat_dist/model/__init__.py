"""The GPT model: megatron-core tensor-parallel layers (``gpt.py``, ``attention.py``) with one object per
position scheme (``positions.py``: GOAT, RoPE, ALiBi, learned or none).

May import: torch, megatron-core's layers, ``goat_dist.config``, ``goat_dist.shapes``, ``goat_dist.data``
(the ignored label id), ``goat_dist.goat`` (the prior), ``goat_dist.kernels`` (the attention calls),
``goat_dist.distributed`` (the ``Layout`` it is built for), ``goat_dist.collectives`` (the loss's
reductions) and ``goat_dist.parallel`` (the context split's types and the plain block call; never to set
itself up). The forward reads no process state: the TP group comes with the layout at construction, the rest
from ``parallel.parallelize``.
"""

from .gpt import GPT, padded_vocab_size

__all__ = ["GPT", "padded_vocab_size"]
