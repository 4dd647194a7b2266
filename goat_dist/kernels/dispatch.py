"""``attend``: one attention call, dispatched on an already resolved backend name."""

from __future__ import annotations

from .backend import FLASH4_ALIBI_ERROR
from .fa2 import flash_attention
from .fa4 import flash4_attention
from .sdpa import eager_attention, sdpa_attention


def attend(
    q, k, v, *, causal: bool, scale: float, backend: str, segments=None, bias=None, return_lse=False, **extra
):
    """One attention call. ``bias`` (B, H or H_kv, L, S): an additive fp32 bias (sdpa and eager);
    ``extra``: kernel arguments that flash-attn 2 takes (``alibi_slopes``: it computes ALiBi itself).

    ``return_lse``: ``(out, lse)`` with lse (B, H, L) fp32, the log-sum-exp of each row's scaled logits;
    flash4 and eager only (torch SDPA does not return it and flash-attn 2 has no gradient for it).
    """
    if backend == "flash4" and (bias is not None or extra):
        raise ValueError(FLASH4_ALIBI_ERROR if "alibi_slopes" in extra else "flash4 takes no attention bias")
    if backend == "flash" and bias is not None:
        raise ValueError("flash-attn 2 takes no bias tensor (ALiBi goes in as alibi_slopes)")
    if backend != "flash" and extra:
        raise ValueError(f"attention backend {backend!r} takes no {sorted(extra)}")
    if return_lse:
        if backend == "flash4":
            return flash4_attention(q, k, v, causal=causal, scale=scale, segments=segments, return_lse=True)
        if backend == "eager":
            return eager_attention(
                q, k, v, causal=causal, scale=scale, bias=bias, segments=segments, return_lse=True
            )
        raise ValueError(f"the log-sum-exp comes from attention backends flash4 and eager, not {backend!r}")
    if backend == "flash4":
        return flash4_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, causal=causal, scale=scale, segments=segments, bias=bias)
    if backend == "flash":
        return flash_attention(q, k, v, causal=causal, scale=scale, segments=segments, **extra)
    if backend == "eager":
        return eager_attention(q, k, v, causal=causal, scale=scale, bias=bias, segments=segments)
    raise ValueError(f"unresolved attention backend {backend!r}")
