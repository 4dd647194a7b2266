"""Context parallelism (``parallel.cp``): the ranks of one CP group share every sequence.

Split. Each row of L tokens is cut into ``2·cp`` chunks of ``c = L / (2·cp)``; CP rank r keeps chunks r
and ``2·cp - 1 - r`` (megatron-core's ``get_batch_on_this_cp_rank``): under a causal mask chunk i costs
~i, so every rank gets the same attention work. Every rank receives the whole row from the loader (the
CP ranks of a replica read the same samples) and keeps its two chunks (``ContextShard.split``); what
depends on the whole row is computed before splitting, from the whole row: positions (global: GOAT
lanes, RoPE, ALiBi, document masking), document segments, GOAT's recency origin, the loss's token count.

Attention: all-gather of K/V (the Llama-3 way). Each rank projects q/k/v for its own tokens only, folds
GOAT's prior lanes into its own q/k (a token's lanes depend only on its global position and the row's
origin), and all-gathers the folded keys and the values over the CP group with a differentiable gather
(``_AllGather``: all-gather forward; its backward, a reduce-scatter, sums the key/value gradients of every
rank back to the rank that owns the tokens). Each local query chunk then attends its key
prefix ``[0, start + c)`` with the causal mask aligned bottom-right (query ``start + i`` sees keys
``<= start + i``), so no rank materialises more than its own rows:

* ``flash`` (GPU): one flash-attn call per chunk, ``causal=True`` with Lq < Lk (flash-attn 2 aligns the
  mask bottom-right); packed documents go through its varlen kernel with separate query/key offsets;
  ``flash4``: the same single call per chunk (no documents, no ALiBi; otherwise the explicit mask);
* ``sdpa`` on CPU, no documents, no ALiBi: torch's CPU flash kernel twice per chunk (the diagonal block,
  causal; the prefix before it, unmasked), merged by log-sum-exp; its backward calls the kernel's own
  backward with the merged output and log-sum-exp, which gives each piece's exact share of the gradient
  (``_PrefixCausal``). Memory O(rows): no mask tensor;
* otherwise (documents, ALiBi, eager, SDPA on GPU, flash4 with documents): an explicit (rows x prefix)
  mask / bias per chunk, through SDPA (or the eager kernel).

Why all-gather and not a ring: K/V are ``2 · H_kv · D`` per token against ``~12 h^2`` of weights-side
activations, the exchange is two all-gathers per layer (K, V) instead of ``cp - 1`` dependent steps, every
kernel is used unmodified, and document masks and ALiBi stay simple index arithmetic. The price is the
whole row's K/V per rank (kept for backward), which is small next to the local activations for GQA models.

Loss and gradients: rank loss = ``cp · (sum of its token losses) / (tokens of the whole row batch)``;
the mean over the CP group is the token-weighted mean of the whole rows. Gradients are averaged over the
DP x CP group (``parallel_state.get_data_parallel_group(with_context_parallel=True)``), which is where
ZeRO partitions: CP ranks hold identical replicas of the weights (CP splits activations only), so they
are data-parallel replicas for the optimizer, and the factor ``cp`` in the rank loss cancels the extra
``1/cp`` of that average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import kernels
from ..attention.exact import sequence_origin
from ..attention.kernels import document_segments
from ..attention.layout import fa2_ready


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


def cp_world() -> tuple[int, int, object]:
    """(cp size, cp rank, cp group) from megatron's parallel_state; (1, 0, None) when it is not set up."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None:
        return 1, 0, None
    return group.size(), group.rank(), group


def context_shard(position_ids: torch.Tensor) -> ContextShard | None:
    """This rank's shard of whole rows with ``position_ids`` (B, L); None without context parallelism."""
    cp, rank, group = cp_world()
    if cp == 1:
        return None
    return make_shard(position_ids, cp, rank, group)


def make_shard(position_ids: torch.Tensor, cp: int, rank: int, group=None) -> ContextShard:
    L = position_ids.shape[1]
    if L % (2 * cp):
        raise ValueError(f"sequence length {L} is not divisible by 2 x parallel.cp = {2 * cp}")
    return ContextShard(
        cp=cp,
        rank=rank,
        group=group,
        chunk=L // (2 * cp),
        positions=position_ids,
        segments=document_segments(position_ids),
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
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None


def reorder_gathered(parts: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """Rank-major pieces ``[chunk r, chunk 2cp-1-r]`` of every rank r -> global chunk order 0..2cp-1."""
    heads = [p[:, :chunk] for p in parts]
    tails = [p[:, chunk:] for p in parts]
    return torch.cat(heads + tails[::-1], dim=1)


# ---- attention of the local chunks against their key prefixes ----------------------------------------
def context_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    shard: ContextShard,
    *,
    scale: float,
    backend: str,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, 2c, H, D) over the whole rows' keys/values
    k_full (B, L, H_kv, D), v_full (B, L, H_kv, Dv) in global order; returns (B, 2c, H, Dv)."""
    c = shard.chunk
    if backend == "sdpa" and q.device.type == "cpu" and shard.segments is None and alibi_slopes is None:
        return _cpu_prefix_causal(q, k_full, v_full, shard.starts, c, scale)
    outs = []
    for j, start in enumerate(shard.starts):
        qj = q[:, j * c : (j + 1) * c]
        end = start + c
        kj, vj = k_full[:, :end], v_full[:, :end]
        if backend == "flash":
            outs.append(_flash_chunk(qj, kj, vj, start, shard, scale, alibi_slopes))
        elif backend == "flash4" and shard.segments is None and alibi_slopes is None:
            # FlashAttention-4 aligns a causal Lq < Lk mask bottom-right too; documents and ALiBi
            # take the explicit-mask path below
            outs.append(kernels.flash4_attention(qj, kj, vj, causal=True, scale=scale))
        else:
            outs.append(_masked_chunk(qj, kj, vj, start, shard, scale, alibi_slopes, backend))
    return torch.cat(outs, dim=1)


def _varlen_index(shard: ContextShard, start: int, B: int, c: int, S: int, device):
    """The varlen kernel's view of chunk ``[start, start + c)`` against keys ``[0, S)`` under packed
    documents: the gathered key rows, cumulative query and key lengths, the longest of each. It needs the
    host (document boundaries), so it is computed once per forward and chunk and kept on the shard, which
    every layer shares (one host sync per chunk and micro-batch, not per layer)."""
    cache = shard.__dict__.setdefault("_varlen", {})
    if (start, c, S) in cache:
        return cache[(start, c, S)]
    seg_q = shard.segments[:, start : start + c]
    seg_k = shard.segments[:, :S].contiguous()
    key_index, cu_q, cu_k = [], [0], [0]
    for b in range(B):
        docs, counts = torch.unique_consecutive(seg_q[b], return_counts=True)
        first_key = torch.searchsorted(seg_k[b], docs).tolist()  # segment ids never decrease along a row
        end = start
        for d_first, n in zip(first_key, counts.tolist()):
            end += n
            key_index.append(torch.arange(d_first, end, device=device) + b * S)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end - d_first)
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    cache[(start, c, S)] = (
        torch.cat(key_index),
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(lengths_q),
        max(lengths_k),
    )
    return cache[(start, c, S)]


def _flash_chunk(q, k, v, start, shard, scale, slopes):
    extra = {} if slopes is None else {"alibi_slopes": slopes.to(device=q.device, dtype=torch.float32)}
    if shard.segments is None:  # Lq < Lk: flash-attn's causal mask is bottom-right aligned
        return kernels.flash_attention(q, k, v, causal=True, scale=scale, **extra)
    flash = kernels._flash_attn()
    if flash is None:
        kernels.resolve_backend("flash")  # the explanatory error
    B, c = q.shape[:2]
    S = k.shape[1]
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    keys, cu_q_t, cu_k_t, max_q, max_k = _varlen_index(shard, start, B, c, S, q.device)
    out = flash.flash_attn_varlen_func(
        fa2_ready(q.reshape(B * c, *q.shape[2:])),  # a view of the projection: 16-byte loads
        k.reshape(B * S, *k.shape[2:])[keys],  # gathered: fresh, aligned copies
        v.reshape(B * S, *v.shape[2:])[keys],
        cu_q_t,
        cu_k_t,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=True,  # per document, bottom-right: query start+i sees its document's keys up to itself
        **extra,
    )
    return out.view(B, c, *out.shape[1:])[..., :dv]


def _masked_chunk(q, k, v, start, shard, scale, slopes, backend):
    """Explicit (rows x prefix) mask or bias: documents, ALiBi, eager, and SDPA off the CPU."""
    c, S = q.shape[1], k.shape[1]
    rows = torch.arange(start, start + c, device=q.device)
    keep = (torch.arange(S, device=q.device)[None, :] <= rows[:, None])[None, None]  # (1, 1, c, S)
    if shard.segments is not None:
        seg = shard.segments
        keep = keep & (seg[:, start : start + c, None] == seg[:, None, :S])[:, None]
    bias = None
    if slopes is not None:
        t = shard.positions.float()
        distance = t[:, start : start + c, None] - t[:, None, :S]  # (B, c, S)
        bias = -slopes.to(q.device)[None, :, None, None] * distance[:, None]
    if backend == "eager":  # its own causal mask is bottom-right aligned; documents join the bias
        if shard.segments is not None:
            blocked = torch.zeros(keep.shape, device=q.device).masked_fill(~keep, float("-inf"))
            bias = blocked if bias is None else bias + blocked
        return kernels.eager_attention(q, k, v, causal=True, scale=scale, bias=bias)
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    mask = keep if bias is None else bias.masked_fill(~keep, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)[..., :dv]


def _cpu_prefix_causal(q, k, v, starts, chunk, scale):
    H, dv = q.shape[2], v.shape[-1]
    group = H // k.shape[2]
    if group > 1:  # the CPU kernel wants equal head counts; autograd sums the copies' gradients
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out = _PrefixCausal.apply(q, k, v, starts, chunk, scale)
    return out.transpose(1, 2)[..., :dv]


_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixCausal(torch.autograd.Function):
    """Query chunks (B, H, n·c, D) at global ``starts`` against keys (B, H, L, D): for each chunk the
    diagonal block (causal) and the prefix before it (no mask) through torch's CPU flash kernel, merged by
    log-sum-exp. Backward: the kernel's backward of each piece with the merged output and log-sum-exp
    (``P = exp(S - lse)``, ``D = rowsum(dO * O)`` are then the whole row's) gives that piece's exact
    contribution to dq, dk, dv. Saved: q, k, v, output and log-sum-exp; no mask, no probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, starts, chunk, scale):
        outs, lses = [], []
        for j, a in enumerate(starts):
            qc = q[:, :, j * chunk : (j + 1) * chunk]
            o, lse = _cpu_flash(qc, k[:, :, a : a + chunk], v[:, :, a : a + chunk], 0.0, True, scale=scale)
            if a > 0:
                o_prefix, lse_prefix = _cpu_flash(qc, k[:, :, :a], v[:, :, :a], 0.0, False, scale=scale)
                merged = torch.logaddexp(lse_prefix, lse)
                wide = torch.promote_types(q.dtype, torch.float32)  # merge in fp32 (fp64 stays fp64)
                o = (
                    o_prefix.to(wide) * torch.exp(lse_prefix - merged)[..., None]
                    + o.to(wide) * torch.exp(lse - merged)[..., None]
                ).to(q.dtype)
                lse = merged
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.starts, ctx.chunk, ctx.scale = starts, chunk, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        c, scale = ctx.chunk, ctx.scale
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for j, a in enumerate(ctx.starts):
            rows = slice(j * c, (j + 1) * c)
            g, qc = grad[:, :, rows].contiguous(), q[:, :, rows].contiguous()
            o, lse_c = out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            pieces = [(slice(a, a + c), True)] + ([(slice(0, a), False)] if a > 0 else [])
            for keys, causal in pieces:
                gq, gk, gv = _cpu_flash_backward(
                    g, qc, k[:, :, keys], v[:, :, keys], o, lse_c, 0.0, causal, scale=scale
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None, None, None
