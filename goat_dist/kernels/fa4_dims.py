"""FlashAttention-4's head dims: which (q/k, v) widths each GPU generation takes, forward and backward,
and the widths the project gives it (``flash4_head_dims``)."""

from __future__ import annotations

import math

# FlashAttention-4 has forward and backward kernels for these compute capability majors: 9 (Hopper),
# 10/11 (Blackwell B200/B300, Thor), 12 (RTX 50 / RTX PRO Blackwell). On 8.x it has no backward pass.
FLASH4_MAJORS = (9, 10, 11, 12)


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
# ``tests/harness/fa4_compile.py`` compiles the real kernels on CPU for every shape the project produces.


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
