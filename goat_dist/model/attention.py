"""Self-attention built from megatron-core tensor-parallel layers, with a pluggable position scheme.

Activations are sequence-first ``[s, b, h]`` as in megatron-core (so sequence parallelism shards dim 0).
A rank owns ``num_kv_heads / tp`` whole KV groups: their q/k/v columns of the fused projection and, for
GOAT, their slice of the prior's per-head parameters.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..attention import GoatPrior, alibi_slopes, attend, goat_attention, split_grouped_qkv
from ..attention.goat import fold_prior, grouped_qkv_width
from ..attention.kernels import eager_attention, flash_attention, resolve_backend, sdpa_attention
from ..config import ModelConfig
from ..parallel.context import ContextShard, context_attention, gather_sequence
from .positions import alibi_bias, apply_rope, rope_cos_sin


class ParallelSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mp_config, init_method, output_init_method):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cfg = cfg
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        self.local_heads, self.local_kv_heads = heads // tp, kv_heads // tp
        self.group = heads // kv_heads
        self.head_dim = cfg.hidden_size // heads
        # auto passes over a kernel that cannot run this position scheme or head size (flash4: ALiBi)
        self.backend = resolve_backend(cfg.attention_backend, position=cfg.position, head_dim=self.head_dim)
        self.prior = None
        self.checkpoint_core = False
        self.content_dim = self.head_dim
        if cfg.position == "goat":
            g = cfg.goat
            self.prior = GoatPrior(
                self.local_kv_heads,
                g.pos_rank,
                g.abs_rank,
                pos_base=g.pos_base,
                abs_base=g.abs_base,
                key_bias=g.key_bias,
                training_seq_len=cfg.goat.train_len or cfg.seq_len,
                prior_init=g.prior_init,
                head_offset=tp_rank * self.local_kv_heads,
                total_kv_heads=kv_heads,
            )
            self.content_dim = self.head_dim - self.prior.num_lanes
            for name, p in self.prior.named_parameters():
                if not name.startswith("sink_mlp."):  # per-head: split with the heads (clipping reads it)
                    tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        if cfg.position == "alibi":
            slopes = alibi_slopes(heads)[tp_rank * self.local_heads : (tp_rank + 1) * self.local_heads]
            self.register_buffer("alibi_slopes", slopes, persistent=False)
        width = grouped_qkv_width(kv_heads, self.group, self.content_dim, self.head_dim)
        self.qkv = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size,
            width,
            config=mp_config,
            init_method=init_method,
            bias=cfg.bias,
            gather_output=False,
        )
        self.proj = tensor_parallel.RowParallelLinear(
            heads * self.head_dim,
            cfg.hidden_size,
            config=mp_config,
            init_method=output_init_method,
            bias=cfg.bias,
            input_is_parallel=True,
            skip_bias_add=False,
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
        (a context-parallel caller passes the whole row's, see ``attention.exact.sequence_origin``).
        ``shard``: context parallelism; x holds this rank's chunks, ``position_ids`` their global
        positions, and the shard the whole rows' segments and origin (``parallel/context.py``)."""
        mixed, _ = self.qkv(x)  # [s, b, local width]; gathers the sequence under SP
        mixed = mixed.transpose(0, 1)
        q, k, v = split_grouped_qkv(mixed, self.local_kv_heads, self.group, self.content_dim, self.head_dim)
        core, extra = (self._attend, (segments, origin)) if shard is None else (self._attend_cp, (shard,))
        if self.checkpoint_core and self.training:  # selective recomputation: keep no L x L activations
            out = checkpoint(core, q, k, v, position_ids, *extra, use_reentrant=False)
        else:
            out = core(q, k, v, position_ids, *extra)
        b, s = out.shape[:2]
        out, _ = self.proj(out.reshape(b, s, -1).transpose(0, 1))  # reduce(-scatter under SP)
        return out

    def _attend_cp(self, q, k, v, position_ids, shard: ContextShard):
        """Context parallel: fold positions into this rank's q/k, all-gather K/V over the CP group, attend
        each local chunk to its key prefix (``parallel.context``)."""
        q, k, scale, slopes = self.fold_positions(q, k, position_ids, shard.origin)
        k_full, v_full = gather_sequence(k, shard), gather_sequence(v, shard)
        return context_attention(
            q, k_full, v_full, shard, scale=scale, backend=self.backend, alibi_slopes=slopes
        )

    def fold_positions(self, q, k, position_ids, origin):
        """For a caller that attends by itself (context-parallel chunks, cached generation): q and k with
        the position scheme applied (GOAT's prior folded in with the whole sequence's ``origin``, RoPE
        rotated), the softmax scale, and ALiBi's slopes for the caller's bias (None for other schemes)."""
        position, slopes, scale = self.cfg.position, None, self.head_dim**-0.5
        if position == "goat":
            q, k = fold_prior(q, k, self.prior, position_ids, causal=True, origin=origin)
            scale = self.content_dim**-0.5
        elif position == "rope":
            cos, sin = rope_cos_sin(position_ids, self.head_dim, self.cfg.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif position == "alibi":
            slopes = self.alibi_slopes
        return q, k, scale, slopes

    def _attend(self, q, k, v, position_ids, segments=None, origin=None):
        position = self.cfg.position
        if position == "goat":
            return goat_attention(
                q,
                k,
                v,
                self.prior,
                position_ids,
                causal=True,
                backend=self.backend,
                segments=segments,
                origin=origin,
            )
        scale = self.head_dim**-0.5
        if position == "rope":
            cos, sin = rope_cos_sin(position_ids, self.head_dim, self.cfg.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if position == "alibi":
            if self.backend == "flash4":  # FA4 has ALiBi only as a CuTe-DSL score_mod: not shipped
                from ..attention.kernels import FLASH4_ALIBI_ERROR

                raise ValueError(FLASH4_ALIBI_ERROR)
            if self.backend == "flash":  # flash-attn computes ALiBi itself, in fp32, from the slopes
                slopes = self.alibi_slopes.to(device=q.device, dtype=torch.float32)
                return flash_attention(
                    q, k, v, causal=True, scale=scale, segments=segments, alibi_slopes=slopes
                )
            bias = alibi_bias(position_ids, self.alibi_slopes)
            if self.backend == "eager":
                return eager_attention(q, k, v, causal=True, scale=scale, bias=bias, segments=segments)
            return sdpa_attention(q, k, v, causal=True, scale=scale, segments=segments, bias=bias)
        return attend(q, k, v, causal=True, scale=scale, backend=self.backend, segments=segments)
