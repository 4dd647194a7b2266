"""Head-dim padding (``pad_to``, and ``pad_v``: the one place v is widened to q's head dim), and what
FlashAttention-2 needs of a tensor's memory, with the copy that gives it.

Padding: a kernel that wants one head dim for q, k and v (flash-attn 2), or that falls back to a slow
path for unequal ones (SDPA's math kernel materialises the L x L probabilities), gets v zero-padded to
q's width; zero lanes of v give zero output lanes and no gradient, and the output is cut back to v's own
width (``out[..., :dv]``).

Memory:

q, k and v often reach a kernel as views: ``split_grouped_qkv`` cuts them out of the fused projection,
so v starts ``(group + 1) * content_dim`` elements into each row (212 bytes for the 125M config in bf16)
and its heads are one fused group apart (340 bytes). flash-attn 2 reads every (batch, token, head) row
16 bytes at a time (``csrc/flash_attn/src/kernel_traits.h``: ``SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>``,
``kGmemElemsPerLoad``), while its Python wrapper only fixes a last dimension that is not contiguous
(``flash_attn/flash_attn_interface.py``: ``maybe_contiguous``) and its C++ entry only checks that
(``csrc/flash_attn/flash_api.cpp``). Such a view would fault ("misaligned address") on the GPU.
FlashAttention-4 copies misaligned inputs itself (``flash_attn/cute/cute_dsl_utils.py``:
``maybe_contiguous``), so only the FA2 calls go through here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FA2_ALIGN_BYTES = 16  # one uint128_t load


def fa2_readable(t: torch.Tensor) -> bool:
    """True when flash-attn 2 can load ``t`` as it is: a unit last stride, and the data pointer and
    every other stride on 16-byte boundaries. A head dim that is not a multiple of 8 is always fine:
    the wrapper pads it (``flash_attn_interface.py``), which makes a fresh, aligned copy."""
    if t.shape[-1] % 8:
        return True
    size = t.element_size()
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return False
    if t.data_ptr() % FA2_ALIGN_BYTES:
        return False
    return all((s * size) % FA2_ALIGN_BYTES == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def fa2_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when flash-attn 2 can read it, else a contiguous copy (the allocator aligns it;
    autograd carries the gradient back to the view)."""
    if fa2_readable(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` zero-padded along its last dim to ``width`` (``x`` itself when it is already that wide)."""
    return x if x.shape[-1] >= width else F.pad(x, (0, width - x.shape[-1]))


def pad_v(v: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """v widened to q/k's head dim ``width`` for a kernel that wants equal head dims, and v's own width
    ``dv``: the caller cuts the kernel's output back with ``out[..., :dv]``. A v as wide or wider is
    returned as it is (the cut then keeps everything)."""
    return pad_to(v, width), v.shape[-1]
