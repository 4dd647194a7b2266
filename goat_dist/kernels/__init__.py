"""Attention kernel calls, behind one interface: ``eager`` (explicit logits), ``sdpa`` (torch),
``flash4`` (FlashAttention-4, ``flash_attn.cute``) and ``flash`` (flash-attn 2); both flash-attn
generations are imported lazily (``flash_imports``), so CPU machines never need them.

Tensors are batch-first and head-split: q and k (B, L, H, D) and (B, S, H_kv, D), v (B, S, H_kv, D_v)
(D_v may differ from D: ``layout.pad_v`` widens v where a kernel wants equal dims), H a multiple of
H_kv (GQA). Every kernel takes the softmax scale explicitly: GOAT folds its own scales into its lanes.

Files: ``backend`` (which kernel runs: ``resolve_backend``, given the GPU's compute capability),
``dispatch`` (``attend``), ``sdpa`` (torch SDPA and the eager reference), ``fa2`` (flash-attn 2),
``fa4`` + ``fa4_dims`` (FlashAttention-4, dense and varlen, and its head-dim rules), ``flash_imports``
(the lazy imports and why they fail), ``layout`` (head-dim padding, FA2's memory alignment), ``masks``
(packed-document segments, varlen offsets, ALiBi's bias), ``chunks`` (a context-parallel rank's query
chunks against their key prefixes), ``warm`` (``goat-dist kernels warm``: a config's FA4 kernels compiled
into FA4's disk cache before training).

May import: torch, ``goat_dist.config`` (the backend names; ``warm`` loads a config),
``goat_dist.shapes`` and ``goat_dist.precision`` (``warm``: a config's head dims and dtype) only: no
model, no GOAT maths, no process groups.
"""

from .backend import (
    BACKENDS,
    DEVICE,
    FLASH4_ALIBI_ERROR,
    device_capability,
    flash4_available,
    flash_available,
    resolve_backend,
)
from .chunks import prefix_attention
from .dispatch import attend
from .fa2 import flash_attention
from .fa4 import flash4_attention, flash4_varlen
from .fa4_dims import FLASH4_MAJORS, flash4_head_dims
from .layout import fa2_ready, pad_to, pad_v
from .masks import alibi_bias, cu_seqlens, document_segments, segment_mask
from .sdpa import eager_attention, sdpa_attention, sdpa_call

__all__ = [
    "BACKENDS",
    "DEVICE",
    "FLASH4_ALIBI_ERROR",
    "FLASH4_MAJORS",
    "alibi_bias",
    "attend",
    "cu_seqlens",
    "device_capability",
    "document_segments",
    "eager_attention",
    "fa2_ready",
    "flash4_attention",
    "flash4_available",
    "flash4_head_dims",
    "flash4_varlen",
    "flash_attention",
    "flash_available",
    "pad_to",
    "pad_v",
    "prefix_attention",
    "resolve_backend",
    "sdpa_attention",
    "sdpa_call",
    "segment_mask",
]
