"""Attention kernels behind one call: ``eager`` (explicit logits), ``sdpa`` (torch), ``flash4``
(FlashAttention-4, ``flash_attn.cute``) and ``flash`` (flash-attn 2); both flash-attn generations are
imported lazily so CPU machines never need them.

Tensors are batch-first and head-split: q and k (B, L, H, D) and (B, S, H_kv, D), v (B, S, H_kv, D_v)
with D_v <= D (equal unless a GOAT module keeps the reference's content dims), H a multiple of H_kv
(GQA). Every kernel takes the softmax scale explicitly: GOAT folds its own scales into its lanes.

``auto`` picks the fastest kernel that imports and supports the device: flash4 on compute capability
9.x-12.x (Hopper, Blackwell), else flash-attn 2, else sdpa (``resolve_backend``).
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS as BACKENDS
from .flash_imports import flash4_api_problem, import_failure, notice_auto_fallback
from .layout import fa2_ready


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


_FLASH4_IMPORT_ERROR: list[str] = []  # why flash_attn.cute is not usable (for the messages)


@functools.cache
def _flash_attn_cute():
    """FlashAttention-4's ``flash_attn.cute.interface`` module, or None (cached, like ``_flash_attn``;
    ``tests/flash4_standin.py`` installs a CPU stand-in there). The PyPI package is ``flash-attn-4``."""
    _FLASH4_IMPORT_ERROR.clear()
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        _FLASH4_IMPORT_ERROR.append(import_failure(exc))
        return None
    problem = flash4_api_problem(interface)  # e.g. FlashAttention-2's older flash_attn/cute/
    if problem:
        _FLASH4_IMPORT_ERROR.append(problem)
        return None
    return interface


def _flash4_unusable() -> str:
    """Why FA4 is not used, for the messages (the import's own error when there was one)."""
    default = "flash_attn.cute (PyPI flash-attn-4) does not import"
    return _FLASH4_IMPORT_ERROR[0] if _FLASH4_IMPORT_ERROR else default


def _device_capability(device=None) -> tuple[int, int] | None:
    """CUDA compute capability (major, minor) of ``device`` (default: the current one); None without
    CUDA. Tests replace this function to fake a GPU generation."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def flash_available() -> bool:
    """flash-attn 2 imports and the GPU is Ampere or newer (its kernels start at compute capability 8.0)."""
    cap = _device_capability()
    return cap is not None and cap[0] >= 8 and _flash_attn() is not None


# FlashAttention-4 has forward and backward kernels for these compute capability majors: 9 (Hopper),
# 10/11 (Blackwell B200/B300, Thor), 12 (RTX 50 / RTX PRO Blackwell). On 8.x it has no backward pass.
FLASH4_MAJORS = (9, 10, 11, 12)


def flash4_available() -> bool:
    cap = _device_capability()
    return cap is not None and cap[0] in FLASH4_MAJORS and _flash_attn_cute() is not None


# ---- FlashAttention-4 head dims -------------------------------------------------------------------------
# FA4's interface (flash_attn/cute/interface.py, ``_validate_head_dims``) takes, for 16-bit inputs, head
# dims divisible by 8 and: on 9.x q/k and v dims in 8..256 (may differ); on 10.x/11.x both in 8..128, or
# (192, 128), or (256, 256). It states no bound for 12.x; the 9.x one is used there. The project pads a
# dim to the next multiple of 8 (zero lanes change neither q.k nor the kept outputs), pads v up to q/k's
# width where only equal dims are taken (256 on 10.x), and runs a v wider than the kernel takes in
# slices (attention is linear in v). Anything else is an error naming the nearest supported head dim.
# Under GQA the backward kernels restrict v's width further: on 9.x ``flash_bwd_sm90.py`` asserts
# ``head_dim == head_dim_v``; on 10.x/11.x the 2-CTA backward (q/k >= 128) stages the fp32 dV tile in
# V's shared memory and fails where it does not fit (``flash_bwd_sm100.py``: "sdV doesn't fit in sV
# storage allocation (2-CTA)"; (128, 64) fails, (128, 104) compiles); 12.x is not compiled by the CI
# check, so it gets equal widths there. On 10.x a v of 32 or less beside a different q/k width fails
# in the backward too, with or without GQA ((64, 32): "failed to perform a valid division"). Where the
# rules say no, v is zero-padded to the q/k width (or, when wider, runs in slices) and the output cut
# back: zero lanes give zero outputs and no gradient.
# ``tests/fa4_compile.py`` compiles the real kernels on CPU for every shape the project produces.


def _flash4_dims_ok(dq: int, dv: int, major: int) -> bool:
    if dq % 8 or dv % 8:
        return False
    if major in (10, 11):
        return (8 <= dq <= 128 and 8 <= dv <= 128) or (dq, dv) in ((192, 128), (256, 256))
    # 9.x: q/k up to 96 get 192-row tiles (``_tile_size_fwd_sm90``), whose output accumulators run out
    # of registers past a v of 192 (ptxas C7602 when compiling (64, 256)): found by the compile check
    return 8 <= dq <= 256 and 8 <= dv <= 256 and (dq > 96 or dv <= 192)


def _flash4_backward_ok(dq: int, dv: int, major: int, gqa: bool) -> bool:
    if dq == dv:
        return True
    if major in (10, 11):  # tile head dims are rounded up to 32; dV staged as 2 gcd(32, tile/2) floats
        tile_q, tile_v = -(-dq // 32) * 32, -(-dv // 32) * 32
        if dv <= 32:  # a 32-wide dV tile does not divide among the warpgroups (MLIR "valid division")
            return False
        return not gqa or dq < 128 or tile_v >= 4 * math.gcd(32, tile_q // 2)
    return not gqa


def _flash4_widths_ok(dq: int, dv: int, major: int, gqa: bool) -> bool:
    return _flash4_dims_ok(dq, dv, major) and _flash4_backward_ok(dq, dv, major, gqa)


def _ceil8(d: int) -> int:
    return -(-d // 8) * 8


def _flash4_rule(major: int) -> str:
    if major in (10, 11):
        return "q/k and v head dims of 8-128, or exactly 256 (or 192 for q/k with 128 for v)"
    return "q/k and v head dims of 8-256"


def flash4_head_dims(dq: int, dv: int, major: int | None, gqa: bool = False) -> tuple[int, int]:
    """The (q/k, v) widths the project gives FlashAttention-4 for head dims ``dq`` (q/k) and ``dv`` (v)
    on compute capability ``major`` (None: unknown, only the multiple-of-8 padding); ``gqa``: fewer KV
    heads than query heads, where the backward kernels take fewer unequal pairs (see above). A returned
    v width below ``dv`` means v goes in slices of that width. Raises ValueError naming the nearest
    supported head dim when there is none."""
    pq, pv = _ceil8(dq), _ceil8(dv)
    if major is None or _flash4_widths_ok(pq, pv, major, gqa):
        return pq, pv
    if pv < pq and _flash4_widths_ok(pq, pq, major, gqa):
        return pq, pq
    narrower = [w for w in range(pv - 8, 7, -8) if _flash4_widths_ok(pq, w, major, gqa)]
    if narrower:
        return pq, narrower[0]
    ok = [h for h in range(8, 1025, 8) if _flash4_dims_ok(h, h, major)]
    below = [h for h in ok if h <= dq]
    above = [h for h in ok if h >= dq]
    nearest = min(ok, key=lambda h: (abs(h - dq), h))
    others = sorted({below[-1] if below else nearest, above[0] if above else nearest} - {nearest})
    also = f" (or {others[0]})" if others else ""
    raise ValueError(
        f"FlashAttention-4 on compute capability {major}.x does not support head dim {dq} for q/k "
        f"(v: {dv}): it takes {_flash4_rule(major)}. The nearest supported head_dim is {nearest}{also}: "
        "set model.hidden_size / model.num_heads to it, or use model.attention_backend=flash "
        "(FlashAttention-2) or sdpa"
    )


FLASH4_ALIBI_ERROR = (
    "model.position=alibi does not run on model.attention_backend=flash4: FlashAttention-4 offers ALiBi "
    "only as a CuTe-DSL score_mod with a matching score_mod_bwd, which goat-dist does not ship. Use "
    "model.attention_backend=flash (FlashAttention-2 computes ALiBi from its slopes; "
    "pip install 'goat-dist[flash2]') or sdpa"
)


def resolve_backend(name: str, *, position: str | None = None, head_dim: int | None = None) -> str:
    """Map ``auto`` to the fastest usable kernel; reject unknown or unavailable ones clearly.

    ``auto``: flash4 when ``flash_attn.cute`` imports and the GPU's compute capability is 9.x-12.x,
    else flash-attn 2 when it imports on CUDA, else sdpa. Given the model's ``position`` scheme and
    ``head_dim``, ``auto`` also passes over flash4 for ALiBi and for a head dim FA4 does not take on
    this GPU, and an explicit ``flash4`` says so at once.
    """
    if name not in BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if flash4_available() and _flash4_fits(position, head_dim):
            return "flash4"
        choice = "flash" if flash_available() else "sdpa"
        cap = _device_capability()
        if cap is not None and cap[0] in FLASH4_MAJORS and _flash_attn_cute() is None:
            why = _flash4_unusable()
            notice_auto_fallback(choice, why)  # on a GPU FA4 would serve: say why it does not, once
        return choice
    if name == "flash4":
        cap = _device_capability()
        if cap is None:
            why = "CUDA is not available"
        elif cap[0] not in FLASH4_MAJORS:
            why = (
                f"this GPU has compute capability {cap[0]}.{cap[1]} and FlashAttention-4 trains only on "
                "9.x-12.x (Hopper, Blackwell); use attention_backend=flash (FlashAttention-2, "
                "pip install 'goat-dist[flash2]') on it"
            )
        elif _flash_attn_cute() is None:
            why = _flash4_unusable()
        else:
            if position == "alibi":
                raise ValueError(FLASH4_ALIBI_ERROR)
            if head_dim is not None:
                flash4_head_dims(head_dim, head_dim, cap[0])
            return name
        raise RuntimeError(
            f"model.attention_backend=flash4 was requested but {why}; install the GPU extra "
            "(pip install 'goat-dist[gpu]') on a Hopper or Blackwell machine, or use attention_backend=sdpa"
        )
    if name == "flash" and not flash_available():
        why = "CUDA is not available" if not torch.cuda.is_available() else "flash-attn does not import"
        raise RuntimeError(
            f"model.attention_backend=flash was requested but {why}; install flash-attn 2 "
            "(pip install 'goat-dist[flash2]', a CUDA build) on a CUDA machine, or use "
            "attention_backend=flash4 or sdpa"
        )
    return name


def _flash4_fits(position: str | None, head_dim: int | None) -> bool:
    if position == "alibi":
        return False
    if head_dim is None:
        return True
    try:
        flash4_head_dims(head_dim, head_dim, _device_capability()[0])
    except ValueError:
        return False
    return True


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
    return_lse: bool = False,
):
    """Readable reference: explicit fp32 logits ``scale * q.k + bias``, mask, softmax, weighted sum.

    ``bias`` is (B, H or H_kv, L, S) and is added unscaled; ``segments`` (B, L) confine attention to
    packed documents. ``return_lse``: also the log-sum-exp of each row's logits, (B, H, L) fp32.
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
    out = torch.einsum("bhls,bshd->blhd", probs, v.float()).to(v.dtype)
    return (out, torch.logsumexp(logits, dim=-1)) if return_lse else out


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
    back. A view it cannot load 16 bytes at a time (v cut out of the fused projection) is copied
    first (``layout.fa2_ready``). ``extra`` goes to the kernel as is (``alibi_slopes``).
    """
    flash = _flash_attn()
    if flash is None:
        resolve_backend("flash")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash-attn does not import")
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
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


def cu_seqlens(segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Packed documents of (B, L) ``segments`` as a varlen kernel takes them: int32 cumulative lengths
    over the flattened batch (documents never span rows) and the longest document.

    Finding the documents needs the host (their number and the longest one size the kernel's grid), so
    the answer is kept on the ``segments`` tensor: the model makes it once per forward and every layer,
    and an activation-checkpointing recompute, reuse it (one host sync per micro-batch, not per layer)."""
    cached = getattr(segments, "_goat_cu_seqlens", None)
    if cached is not None:
        return cached
    B, L = segments.shape
    flat = (segments + torch.arange(B, device=segments.device)[:, None] * (L + 1)).flatten()
    starts = torch.nonzero(torch.diff(flat, prepend=flat[:1] - 1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    segments._goat_cu_seqlens = (cu, int(torch.diff(cu).max()))
    return segments._goat_cu_seqlens


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def flash4_attention(q, k, v, *, causal: bool, scale: float, segments=None, return_lse: bool = False):
    """FlashAttention-4 (``flash_attn.cute.interface``); packed documents run through its varlen kernel.

    FA4 takes different q/k and v head dims, under GQA fewer pairs in its backward; widths are padded
    or v sliced as ``flash4_head_dims`` says for this GPU. ``return_lse``: also the log-sum-exp of each
    row's scaled logits, (B, H, L) fp32 (natural log; -inf for a row that sees no key), differentiable
    (context parallelism merges partial results with it).
    """
    fa4 = _flash_attn_cute()
    if fa4 is None:
        resolve_backend("flash4")  # raises the explanatory error when CUDA or the import is missing
        raise RuntimeError("flash_attn.cute does not import")
    dq, dv = q.shape[-1], v.shape[-1]
    cap = _device_capability(q.device if q.is_cuda else None)
    wq, wv = flash4_head_dims(dq, dv, cap[0] if cap else None, gqa=q.shape[2] != k.shape[2])
    q, k = _pad_to(q, wq), _pad_to(k, wq)
    B, L, H = q.shape[:3]
    if segments is not None:
        cu, max_len = cu_seqlens(segments)
        q, k = q.flatten(0, 1), k.flatten(0, 1)
    outs, lse = [], None
    for first in range(0, dv, wv):  # one call unless v is wider than this GPU's kernel takes
        piece = _pad_to(v[..., first : first + wv], wv)
        want_lse = return_lse and first == 0  # the same for every v slice: keep the first
        if segments is None:
            out, piece_lse = fa4.flash_attn_func(
                q, k, piece, softmax_scale=scale, causal=causal, return_lse=want_lse
            )
        else:
            out, piece_lse = fa4.flash_attn_varlen_func(
                q,
                k,
                piece.flatten(0, 1),
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                softmax_scale=scale,
                causal=causal,
                return_lse=want_lse,
            )
            out = out.view(B, L, *out.shape[1:])
        outs.append(out[..., : min(wv, dv - first)])
        lse = piece_lse if lse is None else lse
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if not return_lse:
        return out
    if segments is not None:  # varlen: (H, total) -> (B, H, L)
        lse = lse.view(H, B, L).transpose(0, 1)
    return out, lse


def attend(q, k, v, *, causal: bool, scale: float, backend: str, segments=None, return_lse: bool = False):
    """One attention call (no bias): dispatch on an already resolved backend name.

    ``return_lse``: ``(out, lse)`` with lse (B, H, L) fp32, the log-sum-exp of each row's scaled logits;
    flash4 and eager only (torch SDPA does not return it and flash-attn 2 has no gradient for it).
    """
    if return_lse:
        if backend == "flash4":
            return flash4_attention(q, k, v, causal=causal, scale=scale, segments=segments, return_lse=True)
        if backend == "eager":
            return eager_attention(q, k, v, causal=causal, scale=scale, segments=segments, return_lse=True)
        raise ValueError(f"the log-sum-exp comes from attention backends flash4 and eager, not {backend!r}")
    if backend == "flash4":
        return flash4_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "flash":
        return flash_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    if backend == "eager":
        return eager_attention(q, k, v, causal=causal, scale=scale, segments=segments)
    raise ValueError(f"unresolved attention backend {backend!r}")
