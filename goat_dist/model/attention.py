"""Self-attention built from megatron-core tensor-parallel layers, with a pluggable position scheme.

Activations are sequence-first ``[s, b, h]`` as in megatron-core (so sequence parallelism shards dim 0).
A rank owns ``num_kv_heads / tp`` whole KV groups: their q/k/v columns of the fused projection and, for
GOAT, their slice of the prior's per-head parameters. The position scheme (``positions.py``) is one
object, ``self.position``; every path (whole rows, context-parallel chunks, cached generation) asks it
what to do with q and k.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from torch import nn

from ..config import ModelConfig
from ..goat import split_grouped_qkv
from ..kernels import attend, resolve_backend
from ..parallel.context import ContextShard, attend_context
from ..parallel.model_parallel import plain_call
from ..shapes import grouped_qkv_width, head_dims, qkv_row_spans
from .compile import ColumnParallelLinear, RowParallelLinear
from .positions import build_position


class ParallelSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mp_config, init_method, output_init_method, tp_group):
        super().__init__()
        tp, tp_rank = tp_group.size(), tp_group.rank()
        self.cfg = cfg
        heads, kv_heads, self.head_dim, content_dim = head_dims(cfg)
        self.local_heads, self.local_kv_heads = heads // tp, kv_heads // tp
        self.group = heads // kv_heads
        # auto passes over a kernel that cannot run this position scheme or head size (flash4: ALiBi)
        self.backend = resolve_backend(cfg.attention_backend, position=cfg.position, head_dim=self.head_dim)
        self.auto = cfg.attention_backend == "auto"
        self.position = build_position(cfg, head_dim=self.head_dim, tp=tp, tp_rank=tp_rank)
        self.prior = self.position.prior  # GOAT's parameters (None for the other schemes)
        if self.prior is not None:
            for name, p in self.prior.named_parameters():
                if not name.startswith("sink_mlp."):  # per-head: split with the heads (clipping reads it)
                    tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.content_dim = self.position.content_dim
        assert self.content_dim == content_dim, (self.content_dim, content_dim)  # shapes.py agrees
        # how the attention core is called: plain, or under activation checkpointing (``selective``,
        # set by ``parallel.model_parallel.apply``)
        self.core_call = plain_call
        width = grouped_qkv_width(kv_heads, self.group, self.content_dim, self.head_dim)
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            width,
            config=mp_config,
            init_method=init_method,
            bias=cfg.bias,
            gather_output=False,
            tp_group=tp_group,
        )
        # drawn at the full head width whatever the scheme, GOAT keeping each q/k head's content rows
        # (``gpt.init_shards_``): GOAT, ALiBi, RoPE and NoPE start from the same q/k/v weights
        self.qkv.full_width_rows = (
            grouped_qkv_width(self.local_kv_heads, self.group, self.head_dim, self.head_dim),
            qkv_row_spans(self.local_kv_heads, self.group, self.content_dim, self.head_dim),
        )
        self.proj = RowParallelLinear(
            heads * self.head_dim,
            cfg.hidden_size,
            config=mp_config,
            init_method=output_init_method,
            bias=cfg.bias,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        segments=None,
        origin=None,
        shard: ContextShard | None = None,
    ) -> torch.Tensor:
        """``origin`` (b, 1): GOAT's per-sequence recency origin; None derives it from ``position_ids``
        (a context-parallel caller passes the whole row's, see ``goat.exact.sequence_origin``).
        ``shard``: context parallelism; x holds this rank's chunks, ``position_ids`` their global
        positions, and the shard the whole rows' segments and origin (``parallel/context.py``)."""
        mixed, _ = self.qkv(x)  # [s, b, local width]; gathers the sequence under SP
        mixed = mixed.transpose(0, 1)
        q, k, v = split_grouped_qkv(mixed, self.local_kv_heads, self.group, self.content_dim, self.head_dim)
        core, extra = (self._attend, (segments, origin)) if shard is None else (self._attend_cp, (shard,))
        out = self.core_call(self, core, q, k, v, position_ids, *extra)
        b, s = out.shape[:2]
        out, _ = self.proj(out.reshape(b, s, -1).transpose(0, 1))  # reduce(-scatter under SP)
        return out

    def _attend_cp(self, q, k, v, position_ids, shard: ContextShard):
        """Context parallel: the scheme applied to this rank's q/k, K/V all-gathered over the CP group,
        each local chunk attending its key prefix (``parallel.context.attend_context``). Eager inside a
        compiled block: dynamo cannot trace the K/V all-gather's process group."""
        return _eager_attend_context(
            q, k, v, position_ids, shard, position=self.position, backend=self.kernel_for(q.dtype)
        )

    def kernel_for(self, dtype: torch.dtype) -> str:
        """The kernel for inputs of ``dtype``: the resolved backend, except that ``auto`` runs fp32 inputs
        (an fp32 run, or an fp32 evaluation) on SDPA, since FlashAttention takes 16-bit inputs only."""
        if self.auto and dtype == torch.float32 and self.backend in FLASH_KERNELS:
            return "sdpa"
        return self.backend

    def _attend(self, q, k, v, position_ids, segments=None, origin=None):
        backend = self.kernel_for(q.dtype)
        q, k, scale, extra = self.position.kernel_inputs(q, k, position_ids, backend=backend, origin=origin)
        call = attend if backend in TRACEABLE else _eager_attend
        return call(q, k, v, causal=True, scale=scale, backend=backend, segments=segments, **extra)


# Kernels torch.compile traces (model.compile); FlashAttention's (flash4: CuTe-DSL JIT code, flash: an
# extension that reads host values for packed documents) and context parallelism's attention run eagerly
# between two compiled graphs.
TRACEABLE = ("sdpa", "eager")
FLASH_KERNELS = ("flash4", "flash")  # 16-bit inputs only
_eager_attend = torch.compiler.disable(attend)
_eager_attend_context = torch.compiler.disable(attend_context)
