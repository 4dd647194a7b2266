"""Attention kernels behind one call: ``eager`` (explicit logits), ``sdpa`` (torch) and ``flash``
(flash-attn 2, imported lazily so CPU machines never need it).

Tensors are batch-first and head-split: q and k (B, L, H, D) and (B, S, H_kv, D), v (B, S, H_kv, D_v)
with D_v <= D (equal unless a GOAT module keeps the reference's content dims), H a multiple of H_kv
(GQA). Every kernel takes the softmax scale explicitly: GOAT folds its own scales into its lanes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS as BACKENDS


def document_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Segment ids (B, L) of packed documents, from positions that restart (``t != t_prev + 1``);
    None when no row has a boundary, so unpacked batches keep the plain causal fast path."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1)


def segment_mask(segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, L, L) boolean mask, True where query i may attend key j: same document (and j <= i)."""
    keep = segments[:, :, None] == segments[:, None, :]
    if causal:
        L = segments.shape[1]
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    return keep[:, None]


@functools.cache
def _flash_attn():
    """The ``flash_attn`` module, or None. Decided by importing: a kernel-less install can have a spec.

    Cached; tests put a CPU stand-in in ``sys.modules["flash_attn"]`` and clear this cache
    (``tests/flash_standin.py``), so the flash paths below run without CUDA.
    """
    try:
        import flash_attn
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    needed = ("flash_attn_func", "flash_attn_varlen_func")
    return flash_attn if all(hasattr(flash_attn, name) for name in needed) else None


def flash_available() -> bool:
    return torch.cuda.is_available() and _flash_attn() is not None


def resolve_backend(name: str) -> str:
    """Map ``auto`` to the fastest usable kernel; reject unknown or unavailable ones clearly."""
    if name not in BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "flash" if flash_available() else "sdpa"
    if name == "flash" and not flash_available():
        why = "CUDA is not available" if not torch.cuda.is_available() else "flash-attn does not import"
        raise RuntimeError(
            f"model.attention_backend=flash was requested but {why}; install the GPU extra "
            "(pip install 'goat-dist[gpu]') on a CUDA machine, or use attention_backend=sdpa"
        )
    return name


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    group = n_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Readable reference: explicit fp32 logits ``scale * q.k + bias``, mask, softmax, weighted sum.

    ``bias`` is (B, H or H_kv, L, S) and is added unscaled; ``segments`` (B, L) confine attention to
    packed documents.
    """
    H = q.shape[2]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    logits = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * scale
    if bias is not None:
        logits = logits + (bias if bias.shape[1] == H else bias.repeat_interleave(H // bias.shape[1], dim=1))
    if segments is not None:
        logits = logits.masked_fill(~segment_mask(segments, causal), float("-inf"))
    elif causal:
        L, S = logits.shape[-2:]
        future = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(S - L + 1)
        logits = logits.masked_fill(future, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.einsum("bhls,bshd->blhd", probs, v.float()).to(v.dtype)


def sdpa_attention(q, k, v, *, causal: bool, scale: float, segments=None, bias=None) -> torch.Tensor:
    """torch SDPA; packed documents (``segments``) or an additive ``bias`` go in as an explicit mask.

    A v narrower than q/k is zero-padded: with unequal head dims SDPA falls back to its math kernel,
    which materialises the L x L probabilities (gigabytes at L = 32k).
    """
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    mask = None
    if segments is not None or bias is not None:
        keep = segment_mask(segments, causal) if segments is not None else None
        if keep is None and causal:
            L = q.shape[1]
            keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)[..., :dv]


def flash_attention(q, k, v, *, causal: bool, scale: float, segments=None, **extra) -> torch.Tensor:
    """flash-attn 2; packed documents run through its varlen kernel (no mask, no padding).

    flash-attn 2 needs one head dim for q, k and v: a narrower v (a GOAT module whose prior lanes come on
    top of the reference's content dims, see ``GoatSelfAttention``) is zero-padded and the output cut
    back. ``extra`` goes to the kernel as is (``alibi_slopes``).
    """
    flash = _flash_attn()
    if flash is None:
        resolve_backend("flash")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash-attn does not import")
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    if segments is None:
        out = flash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **extra)
        return out[..., :dv]
    B, L = segments.shape
    flat = (segments + torch.arange(B, device=segments.device)[:, None] * (L + 1)).flatten()
    starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    max_len = int(torch.diff(cu).max())
    out = flash.flash_attn_varlen_func(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        cu,
        cu,
        max_len,
        max_len,
        softmax_scale=scale,
        causal=causal,
        **extra,
    )
    return out.view(B, L, *out.shape[1:])[..., :dv]


def attend(q, k, v, *, causal: bool, scale: float, backend: str, segments=None) -> torch.Tensor:
    """One attention call (no bias): dispatch on an already resolved backend name."""
    if backend == "sdpa":
        return sdpa_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "flash":
        return flash_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "eager":
        return eager_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    raise ValueError(f"unresolved attention backend {backend!r}")
