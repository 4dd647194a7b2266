"""flash-attn 2 (``flash_attn``), imported lazily; packed documents through its varlen kernel."""

from __future__ import annotations

from . import backend, flash_imports
from .layout import fa2_ready, pad_v
from .masks import cu_seqlens


def flash2_module():
    """The ``flash_attn`` module; the explanatory error when CUDA or the import is missing."""
    flash = flash_imports._flash_attn()
    if flash is None:
        backend.resolve_backend("flash")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash-attn does not import")
    return flash


def flash_attention(q, k, v, *, causal: bool, scale: float, segments=None, **extra):
    """flash-attn 2; packed documents run through its varlen kernel (no mask, no padding).

    flash-attn 2 needs one head dim for q, k and v: a narrower v (a GOAT module whose prior lanes come on
    top of the reference's content dims, see ``GoatSelfAttention``) is zero-padded and the output cut
    back (``pad_v``). A view it cannot load 16 bytes at a time (v cut out of the fused projection) is
    copied first (``layout.fa2_ready``). ``extra`` goes to the kernel as is (``alibi_slopes``).
    """
    flash = flash2_module()
    v, dv = pad_v(v, q.shape[-1])
    if segments is None:
        q, k, v = fa2_ready(q), fa2_ready(k), fa2_ready(v)
        out = flash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **extra)
        return out[..., :dv]
    B, L = segments.shape
    cu, max_len = cu_seqlens(segments)
    out = flash.flash_attn_varlen_func(
        fa2_ready(q.flatten(0, 1)),
        fa2_ready(k.flatten(0, 1)),
        fa2_ready(v.flatten(0, 1)),
        cu,
        cu,
        max_len,
        max_len,
        softmax_scale=scale,
        causal=causal,
        **extra,
    )
    return out.view(B, L, *out.shape[1:])[..., :dv]
