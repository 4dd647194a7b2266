"""Attention of a context-parallel rank's query chunks against their key prefixes (the kernel side of
``parallel/context.py``, which splits the rows and gathers K/V): each local chunk ``[start, start + c)``
attends keys ``[0, start + c)`` with the causal mask aligned bottom-right.

* ``flash`` / ``flash4``: one flash-attn 2 / FlashAttention-4 call per chunk (Lq < Lk: both align the
  causal mask bottom-right); packed documents through their varlen kernels with separate query/key
  offsets (``_varlen_index``): each document's queries in the chunk against that document's keys up to
  the chunk end, so no mask is built and whole key blocks outside the document are never visited;
* ``sdpa`` on CPU, no documents, no ALiBi: torch's CPU flash kernel twice per chunk (the diagonal block,
  causal; the prefix before it, unmasked), merged by log-sum-exp (``_PrefixCausal``); memory O(rows);
* otherwise (documents or ALiBi on sdpa / eager, SDPA on GPU): an explicit (rows x prefix) mask / bias
  per chunk, through SDPA (or the eager kernel). FlashAttention-4 takes no ALiBi (the model refuses it
  before this point).
"""

from __future__ import annotations

import torch

from .fa2 import flash2_module, flash_attention
from .fa4 import flash4_attention, flash4_varlen
from .layout import fa2_ready, pad_v
from .masks import alibi_bias, host_segments
from .sdpa import eager_attention, sdpa_call


def prefix_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    shard,
    *,
    scale: float,
    backend: str,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, 2c, H, D) over the whole rows' keys/values
    k_full (B, L, H_kv, D), v_full (B, L, H_kv, Dv) in global order; returns (B, 2c, H, Dv).

    ``shard`` (``parallel.context.ContextShard``) says where the local chunks start (``starts``, each
    ``chunk`` long) and holds the whole rows' ``positions`` (ALiBi) and ``segments`` (documents);
    ``alibi_slopes`` (H,): ALiBi, computed by flash-attn 2 itself or as an explicit bias."""
    c = shard.chunk
    if backend == "sdpa" and q.device.type == "cpu" and shard.segments is None and alibi_slopes is None:
        return _cpu_prefix_causal(q, k_full, v_full, shard.starts, c, scale)
    outs = []
    for j, start in enumerate(shard.starts):
        qj = q[:, j * c : (j + 1) * c]
        end = start + c
        kj, vj = k_full[:, :end], v_full[:, :end]
        if backend == "flash":
            outs.append(_flash_chunk(qj, k_full, v_full, start, shard, scale, alibi_slopes))
        elif backend == "flash4" and alibi_slopes is None:
            outs.append(_flash4_chunk(qj, k_full, v_full, start, shard, scale))
        else:
            outs.append(_masked_chunk(qj, kj, vj, start, shard, scale, alibi_slopes, backend))
    return torch.cat(outs, dim=1)


def _varlen_index(shard, start: int, B: int, c: int, L: int, device):
    """The varlen kernels' view of chunk ``[start, start + c)`` under packed documents, against whole
    rows of L keys flattened to (B·L): which key rows to pack (``keys``), cumulative query and key
    lengths (int32), the longest of each. Sequence i is one document's queries in the chunk and that
    document's keys from its first token up to the chunk end (the causal mask, aligned bottom-right,
    does the rest), so a query never meets another document's key and the kernel never visits one.

    A row's documents follow one another, so its key ranges join into one run ``[first key of its
    first document in the chunk, chunk end)``; with one row (the long-context configs' micro-batch) the
    keys are that single slice, a view of the gathered K/V (no copy, nothing extra kept for the
    backward), else an index over the runs (a gathered copy, as flash-attn's varlen layout needs
    sequences packed back to back). Not ``seqused_k`` over the unpacked rows: FA4's backward allocates
    dK/dV with ``torch.empty_like`` (``_flash_attn_bwd``) and writes only rows inside a sequence, so the
    key rows between sequences would carry garbage gradients.

    It needs the document boundaries on the host: computed from the host copy of the segments
    (``masks.host_segments``: no further read after ``document_segments``'), once per forward and chunk,
    and kept on the shard, which every layer shares."""
    cache = shard.__dict__.setdefault("_varlen", {})
    if (start, c, L) in cache:
        return cache[(start, c, L)]
    host = host_segments(shard.segments)  # the documents, read once per micro-batch
    seg_q = host[:, start : start + c]
    seg_k = host[:, : start + c].contiguous()
    runs, cu_q, cu_k = [], [0], [0]
    for b in range(B):
        docs, counts = torch.unique_consecutive(seg_q[b], return_counts=True)
        first_key = torch.searchsorted(seg_k[b], docs).tolist()  # segment ids never decrease along a row
        end = start
        for d_first, n in zip(first_key, counts.tolist()):
            end += n
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end - d_first)
        runs.append((b * L + first_key[0], b * L + end))  # the row's documents' keys, back to back
    if len(runs) == 1:
        keys = slice(*runs[0])
    else:
        keys = torch.cat([torch.arange(lo, hi) for lo, hi in runs]).to(device)
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    cache[(start, c, L)] = (
        keys,
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(lengths_q),
        max(lengths_k),
    )
    return cache[(start, c, L)]


def _packed_keys(x_full: torch.Tensor, keys) -> torch.Tensor:
    """(B, L, H_kv, D) whole rows -> the packed key rows ``keys`` (a slice: a view; an index: a copy)."""
    return x_full.flatten(0, 1)[keys]


def _flash_chunk(q, k_full, v_full, start, shard, scale, slopes):
    extra = {} if slopes is None else {"alibi_slopes": slopes.to(device=q.device, dtype=torch.float32)}
    B, c = q.shape[:2]
    if shard.segments is None:  # Lq < Lk: flash-attn's causal mask is bottom-right aligned
        end = start + c
        return flash_attention(q, k_full[:, :end], v_full[:, :end], causal=True, scale=scale, **extra)
    flash = flash2_module()
    keys, cu_q_t, cu_k_t, max_q, max_k = _varlen_index(shard, start, B, c, k_full.shape[1], q.device)
    v, dv = pad_v(_packed_keys(v_full, keys), q.shape[-1])
    out = flash.flash_attn_varlen_func(
        fa2_ready(q.reshape(B * c, *q.shape[2:])),  # a view of the projection: 16-byte loads
        fa2_ready(_packed_keys(k_full, keys)),  # a gathered copy is fresh and aligned; a slice may not be
        fa2_ready(v),
        cu_q_t,
        cu_k_t,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=True,  # per document, bottom-right: query start+i sees its document's keys up to itself
        **extra,
    )
    return out.view(B, c, *out.shape[1:])[..., :dv]


def _flash4_chunk(q, k_full, v_full, start, shard, scale):
    """FlashAttention-4 for one chunk: ``flash_attn_func`` with Lq < Lk (its causal mask is aligned
    bottom-right), or under packed documents its varlen kernel with separate query and key offsets
    (``_varlen_index``). FA4 copies views it cannot load itself and takes q/k and v of different widths
    (``GoatSelfAttention``'s lanes can make q/k wider than v), padded as ``fa4.flash4_varlen`` says."""
    B, c = q.shape[:2]
    if shard.segments is None:
        end = start + c
        return flash4_attention(q, k_full[:, :end], v_full[:, :end], causal=True, scale=scale)
    keys, cu_q, cu_k, max_q, max_k = _varlen_index(shard, start, B, c, k_full.shape[1], q.device)
    out = flash4_varlen(
        q.reshape(B * c, *q.shape[2:]),
        _packed_keys(k_full, keys),
        _packed_keys(v_full, keys),
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=True,  # per document, bottom-right: query start+i sees its document's keys up to itself
        scale=scale,
    )
    return out.view(B, c, *out.shape[1:])


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
        bias = alibi_bias(slopes.to(q.device), shard.positions[:, start : start + c], shard.positions[:, :S])
    if backend == "eager":  # its own causal mask is bottom-right aligned; documents join the bias
        if shard.segments is not None:
            blocked = torch.zeros(keep.shape, device=q.device).masked_fill(~keep, float("-inf"))
            bias = blocked if bias is None else bias + blocked
        return eager_attention(q, k, v, causal=True, scale=scale, bias=bias)
    mask = keep if bias is None else bias.masked_fill(~keep, float("-inf")).to(q.dtype)
    return sdpa_call(q, k, v, scale=scale, mask=mask)


def _cpu_prefix_causal(q, k, v, starts, chunk, scale):
    H = q.shape[2]
    group = H // k.shape[2]
    if group > 1:  # the CPU kernel wants equal head counts; autograd sums the copies' gradients
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    v, dv = pad_v(v, q.shape[-1])
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
