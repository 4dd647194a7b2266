"""Context parallelism (``parallel.cp``): the ranks of one CP group share every sequence.

Split. Each row of L tokens is cut into ``2·cp`` chunks of ``c = L / (2·cp)``; CP rank r keeps chunks r
and ``2·cp - 1 - r`` (megatron-core's ``get_batch_on_this_cp_rank``): under a causal mask chunk i costs
~i, so every rank gets the same attention work. Every rank receives the whole row from the loader (the
CP ranks of a replica read the same samples) and keeps its two chunks (``ContextShard.split``); what
depends on the whole row is computed before splitting, from the whole row: positions (global: GOAT
lanes, RoPE, ALiBi, document masking), document segments, GOAT's recency origin, the loss's token count.

Attention (``attend_context``): all-gather of K/V (the Llama-3 way). Each rank projects q/k/v for its
own tokens only, applies the position scheme to its own q/k (``fold``: GOAT's prior lanes, which depend
only on a token's global position and the row's origin; RoPE's rotation), and all-gathers the folded
keys and the values over the CP group with a differentiable gather (``_AllGather``: all-gather forward;
its backward, a reduce-scatter, sums the key/value gradients of every rank back to the rank that owns the
tokens). Each local query chunk then attends its key prefix ``[0, start + c)`` with the causal mask
aligned bottom-right (query ``start + i`` sees keys ``<= start + i``), so no rank materialises more than
its own rows. The kernel calls per chunk are
``kernels/chunks.py`` (``context_attention`` here): one flash-attn call per chunk, torch's CPU flash
kernel merged by log-sum-exp, or an explicit (rows x prefix) mask / bias.

Why all-gather and not a ring: K/V are ``2 · H_kv · D`` per token against ``~12 h^2`` of weights-side
activations, the exchange is two all-gathers per layer (K, V) instead of ``cp - 1`` dependent steps, every
kernel is used unmodified, and document masks and ALiBi stay simple index arithmetic. The price is the
whole row's K/V per rank (kept for backward), which is small next to the local activations for GQA models.

Loss and gradients: rank loss = ``cp · (sum of its token losses) / (tokens of the whole row batch)``;
the mean over the CP group is the token-weighted mean of the whole rows. Gradients are averaged over the
DP x CP group (the layout's ``replica_group``), which is where
ZeRO partitions: CP ranks hold identical replicas of the weights (CP splits activations only), so they
are data-parallel replicas for the optimizer, and the factor ``cp`` in the rank loss cancels the extra
``1/cp`` of that average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..goat.exact import sequence_origin
from ..kernels import document_segments
from ..kernels import prefix_attention as context_attention

__all__ = [
    "ContextParallel",
    "ContextShard",
    "attend_context",
    "context_attention",
    "gather_sequence",
    "make_shard",
    "reorder_gathered",
    "split_rows",
]


@dataclass
class ContextShard:
    """One CP rank's view of a batch of whole rows."""

    cp: int
    rank: int
    group: object  # the CP process group (None in single-process tests that gather by hand)
    chunk: int  # c = L / (2·cp)
    positions: torch.Tensor  # (B, L) the whole rows' position ids
    segments: torch.Tensor | None  # (B, L) the whole rows' document ids (None: one document per row)
    origin: torch.Tensor  # (B, 1) GOAT's recency origin of the whole rows

    @property
    def chunk_ids(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    @property
    def starts(self) -> tuple[int, int]:
        """Global index of the first token of each local chunk (head, tail)."""
        return tuple(i * self.chunk for i in self.chunk_ids)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) whole rows -> (B, 2c, ...) this rank's two chunks (megatron's head-tail order)."""
        return split_rows(x, self.cp, self.rank)

    def local_index(self) -> torch.Tensor:
        """Global indices (2c,) of this rank's tokens."""
        return self.split(torch.arange(2 * self.cp * self.chunk)[None])[0]


def split_rows(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The semantics of ``megatron.core.utils.get_batch_on_this_cp_rank`` for one (B, L, ...) tensor."""
    if cp == 1:
        return x
    L = x.shape[1]
    view = x.reshape(x.shape[0], 2 * cp, L // (2 * cp), *x.shape[2:])
    index = torch.tensor([rank, 2 * cp - 1 - rank], device=x.device)
    return view.index_select(1, index).reshape(x.shape[0], L // cp, *x.shape[2:])


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its CP group (from the model's layout, ``model_parallel.apply``); the model's
    forward asks it for the shard of each batch."""

    cp: int
    rank: int
    group: object = None

    def shard(self, position_ids: torch.Tensor, documents: bool = True) -> ContextShard:
        return make_shard(position_ids, self.cp, self.rank, self.group, documents)


def make_shard(
    position_ids: torch.Tensor, cp: int, rank: int, group=None, documents: bool = True
) -> ContextShard:
    """``documents``: look for packed documents in the whole rows (a host sync); False: one per row."""
    L = position_ids.shape[1]
    if L % (2 * cp):
        raise ValueError(f"sequence length {L} is not divisible by 2 x parallel.cp = {2 * cp}")
    return ContextShard(
        cp=cp,
        rank=rank,
        group=group,
        chunk=L // (2 * cp),
        positions=position_ids,
        segments=document_segments(position_ids) if documents else None,
        origin=sequence_origin(position_ids),
    )


def gather_sequence(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """(B, 2c, ...) local tokens -> (B, L, ...) the whole rows in global order; differentiable (the
    backward sums every rank's gradient of a token back to the rank that owns it)."""
    return reorder_gathered(list(_AllGather.apply(x, shard.group).unbind(0)), shard.chunk)


class _AllGather(torch.autograd.Function):
    """all_gather_into_tensor forward, reduce_scatter_tensor (sum) backward, over ``group``.

    Not ``torch.distributed.nn.functional.all_gather``: its gloo backward scatters from *global* rank i
    of the group's i-th member, which fails for a CP group that is not ranks 0..cp-1 (any TP > 1)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty(size * x.shape[0], *x.shape[1:])  # gloo wants the ranks along dim 0
        collectives.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):

        out = grad.new_empty(grad.shape[1:])
        collectives.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None


def reorder_gathered(parts: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """Rank-major pieces ``[chunk r, chunk 2cp-1-r]`` of every rank r -> global chunk order 0..2cp-1."""
    heads = [p[:, :chunk] for p in parts]
    tails = [p[:, chunk:] for p in parts]
    return torch.cat(heads + tails[::-1], dim=1)


def attend_context(q, k, v, position_ids, shard: ContextShard, *, position, backend: str) -> torch.Tensor:
    """Attention of this rank's tokens (q, k, v (B, 2c, H(_kv), D), their global ``position_ids``) under
    context parallelism: the position scheme ``position`` (``model.positions``) applied to the local q/k
    with the whole row's origin, the keys and values all-gathered over the CP group, and each local
    chunk attending its key prefix."""
    q, k = position.fold(q, k, position_ids, shard.origin)
    k_full, v_full = gather_sequence(k, shard), gather_sequence(v, shard)
    return context_attention(
        q, k_full, v_full, shard, scale=position.scale, backend=backend, alibi_slopes=position.slopes()
    )
