"""A plain-torch stand-in for FlashAttention-4's public interface (``flash_attn.cute.interface``, PyPI
``flash-attn-4``) that applies the real interface's input rules.

The product holds it for two callers: ``goat-dist plan --rehearse``, which runs one rank's real training
step on the meta device, where the model's FA4 calls must meet the rules an H100/H200 would apply
(``installed`` puts it in place of the real module; a call the real kernel would refuse raises
``KernelRefusal``), and the tests, which run the project's flash4 paths on CPU against it.

Written from the documented interface of flash-attn-4 4.0.0b36 (``flash_attn_func`` /
``flash_attn_varlen_func``, their docstring and the input checks of ``_flash_attn_fwd`` and
``_validate_head_dims``), not from its kernels:

* ``flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
  window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
  deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
  aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False, ...)``
  with q (B, Lq, H, D), k (B, Lk, H_kv, D), v (B, Lk, H_kv, D_v): D_v may differ from D;
* ``flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
  max_seqlen_k=None, ..., softmax_scale=None, causal=False, ..., return_lse=False, ...)``: the fourth
  positional argument is ``qv``, so the cumulative lengths go by keyword; packed q (total_q, H, D), k and
  v (total_k, H_kv, D / D_v), int32 contiguous ``cu_seqlens`` of shape (batch + 1,); sequence i is
  queries ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` against keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``,
  whose lengths may differ (a context-parallel chunk's documents: fewer queries than keys);
* both return ``(out, lse)``: out in the input dtype, lse fp32 (B, H, Lq) or (H, total_q) for varlen,
  the natural-log log-sum-exp of each row of scaled logits (-inf, with a zero output row, for a row that
  sees no key); lse is None unless ``return_lse`` or an input requires grad; it is differentiable;
* GQA: H a multiple of H_kv, query head h reads KV head ``h // (H / H_kv)``; causal masks aligned to
  the bottom-right corner when Lq != Lk (query i sees keys j <= i + Lk - Lq);
* head dims (``_validate_head_dims``, for 16-bit inputs: divisible by 16 / element size = 8): on compute
  capability 9.x q/k and v dims in 8..256; on 10.x/11.x both in 8..128, or (192, 128), or (256, 256);
  on 9.x also a v of at most 192 beside q/k of at most 96 (found by compiling: ``head_dims_supported``);
  The stand-in's ``arch`` (default 90) says which GPU it plays; FA4 states no bound for 12.x.

Like the real kernel it rejects inputs other than fp16/bf16, q/k/v of different dtypes, H not a multiple
of H_kv, mismatched shapes, unsupported head dims and cu_seqlens that are not int32, not contiguous or
not of length batch + 1: ``KernelRefusal`` (an AssertionError, as the real asserts), whose ``rule`` is
the real message. ``tests/harness/fa4_compile.py`` holds these checks against the real interface's own
(``fa4_interface.argument_rules``: one rule broken per call, both must refuse). Rules of the backward
kernels, found by compiling them on CPU (``tests/harness/fa4_compile.py``), fail like the real one, at
the first backward pass (``KernelRefusal`` with the kernel's message):

* GQA on 9.x: ``head_dim == head_dim_v`` (``flash_attn/cute/flash_bwd_sm90.py``, ``__init__``);
* 10.x/11.x, with or without GQA: a v of 32 or less beside a q/k tile of 64 or 128 (``(64, 32)``,
  ``(40, 32)``; ``(72, 32)`` compiles) fails in ``flash_bwd_sm100.py`` (MLIR "failed to perform a
  valid division" splitting the dV tile among the warpgroups);
* GQA on 10.x/11.x with q/k of 128 or more (the 2-CTA backward, ``interface.py``: ``use_2cta_instrs =
  head_dim >= 128``): the dV tile is staged in fp32, ``tile_n x 2 gcd(32, tile_hdim / 2)`` floats, in
  V's shared memory, ``tile_n x tile_hdimv`` 16-bit values, head dims rounded up to 32
  (``flash_bwd_sm100.py``: "sdV doesn't fit in sV storage allocation (2-CTA)"); (128, 64) fails,
  (128, 104) compiles.

Misaligned or strided views are fine: the real interface copies them (``cute_dsl_utils.py``:
``maybe_contiguous``). ``fa2_cute_interface()`` builds the older ``flash_attn/cute/interface.py`` that
the FlashAttention-2 sdist (2.8.3.post2) installs over FA4's: its ``flash_attn_func`` has no
``return_lse``. ``Flash4Standin(allow_fp32=True)`` is the explicit switch that also accepts fp32 (with
the 16-bit head-dim alignment), for exact comparisons against sdpa at 1e-5. It does not check that
tensors are on CUDA (its purpose is to run on CPU and meta). Features the project does not use (qv,
gather/paged KV, sliding windows, softcapping, learnable sinks, score/mask mods, block sparsity, seqused,
split-KV) raise NotImplementedError.

Numerics follow the kernel's contract: inputs upcast exactly, logits and softmax in fp32, the
probabilities rounded to the input dtype before the (fp32-accumulated) product with V, output in the
input dtype. Gradients (of out and lse) come from torch autograd through the same explicit computation.

Meta tensors (the rehearsal): every rule above that needs no data still runs (dtypes, shapes, head dims,
cu_seqlens' dtype, length and contiguity, the backward rules at the backward pass), and the outputs
have the documented shapes and dtypes and stay on the autograd graph. What needs the values of meta
``cu_seqlens`` is skipped: that they start at 0, end at the packed totals and do not decrease, the
lengths against ``max_seqlen_q/k`` (host ints in the real interface) and the per-sequence masks; such a
varlen call attends over all packed tokens as one sequence (the same shapes) and records no lengths in
``varlen``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import torch

from .refusal import KernelRefusal

_NOT_IMPLEMENTED = {  # keyword: the value that means "off"
    "qv": None,
    "gather_kv_indices": None,
    "page_table": None,
    "window_size": (None, None),
    "learnable_sink": None,
    "softcap": 0.0,
    "num_splits": 1,
    "score_mod": None,
    "score_mod_bwd": None,
    "mask_mod": None,
    "aux_tensors": None,
    "aux_scalars": None,
    "block_sparse_tensors": None,
    "block_sparse_tensors_bwd": None,
    "seqused_q": None,
    "seqused_k": None,
    "min_seqlen_k": None,
    "scheduler_metadata": None,
}


def head_dims_supported(dq: int, dv: int, arch: int, alignment: int = 8) -> bool:
    """FA4's documented head-dim rule for compute capability ``arch`` (e.g. 90, 100)."""
    if dq % alignment or dv % alignment:
        return False
    major = arch // 10
    if major in (10, 11):
        standard = 8 <= dq <= 128 and 8 <= dv <= 128
        return standard or (dq, dv) == (192, 128) or (dq, dv) == (256, 256)
    # 9.x, found by compiling: q/k up to 96 run 192-row tiles (interface.py ``_tile_size_fwd_sm90``)
    # whose accumulators exceed the registers past a v of 192 (ptxas C7602 at (64, 256))
    return 8 <= dq <= 256 and 8 <= dv <= 256 and (dq > 96 or dv <= 192)


def backward_refusal(dq: int, dv: int, heads: int, kv_heads: int, arch: int) -> str | None:
    """The message of FA4's backward kernel refusing these head dims, or None (module docstring)."""
    if dq == dv:
        return None
    major = arch // 10
    tile_q = -(-dq // 32) * 32
    if major in (10, 11) and dv <= 32 and tile_q in (64, 128):
        return "failed to perform a valid division of the dV tile (flash_bwd_sm100.py)"
    if heads == kv_heads:
        return None
    if major == 9:
        return "GQA backward requires head_dim == head_dim_v"
    if major in (10, 11) and dq >= 128:
        tile_hdim, tile_hdimv = (-(-d // 32) * 32 for d in (dq, dv))
        if tile_hdimv < 4 * math.gcd(32, tile_hdim // 2):
            return "sdV doesn't fit in sV storage allocation (2-CTA)"
    return None


class _RefuseBackward(torch.autograd.Function):
    """Identity forward; the backward raises what the real backward kernel asserts."""

    @staticmethod
    def forward(ctx, x, kernel, message):
        ctx.kernel, ctx.message = kernel, message
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise KernelRefusal(ctx.kernel, ctx.message)


class Flash4Standin:
    """The stand-in's two functions, bound to a dtype policy (``allow_fp32``) and a GPU (``arch``)."""

    def __init__(self, allow_fp32: bool = False, arch: int = 90):
        self.allow_fp32 = allow_fp32
        self.arch = arch
        self.calls: list[str] = []  # which entry points ran: tests assert the flash4 path was taken
        # each varlen call's (query lengths, key lengths) per packed sequence: tests assert how a
        # context-parallel chunk was split by document
        self.varlen: list[tuple[list[int], list[int]]] = []

    # ---- checks (the real interface's) ---------------------------------------------------------------
    def _refuse(self, entry: str, rule: str, got: str | None = None) -> KernelRefusal:
        return KernelRefusal(f"FlashAttention-4 {entry} (SM{self.arch})", rule, got)

    def _check(self, entry: str, q, k, v, options: dict) -> None:
        for name, off in _NOT_IMPLEMENTED.items():
            value = options.get(name, off)
            if not (value is off or (not torch.is_tensor(value) and value == off)):
                raise NotImplementedError(f"flash4 stand-in: {name} is not implemented")
        dtypes = f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.allow_fp32 else ())
        if v.dtype not in allowed:
            raise self._refuse(entry, "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2", dtypes)
        if q.dtype != v.dtype or k.dtype != v.dtype:
            raise self._refuse(entry, "q, k, v, and qv must have the same dtype", dtypes)
        if q.shape[-2] % k.shape[-2]:
            got = f"{q.shape[-2]} query heads, {k.shape[-2]} KV heads"
            raise self._refuse(entry, "num_head must be divisible by num_head_kv", got)
        dq, dv = q.shape[-1], v.shape[-1]
        if k.shape[-1] != dq or k.shape[:-1] != v.shape[:-1]:
            rule = f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q's head dim {dq}"
            raise self._refuse(entry, rule)
        if not head_dims_supported(dq, dv, self.arch):
            raise self._refuse(
                entry, f"(head_dim, head_dim_v)=({dq}, {dv}) is not supported on SM{self.arch}"
            )

    # ---- one sequence, explicit math -------------------------------------------------------------------
    @staticmethod
    def _one(q, k, v, scale: float, causal: bool):
        """q (Lq, H, D), k (Lk, H_kv, D), v (Lk, H_kv, D_v) -> out (Lq, H, D_v), lse (H, Lq) fp32."""
        Lq, H = q.shape[:2]
        Lk, H_kv = k.shape[:2]
        device = q.device
        kv_head = torch.arange(H, device=device) // (H // H_kv)  # query head h reads KV head h // group
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()[:, kv_head]) * scale
        empty = torch.zeros(Lq, dtype=torch.bool, device=device) | (Lk == 0)
        if causal:
            i = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)
            j = torch.arange(Lk, device=device)[None, :]
            logits = logits.masked_fill(j > i, float("-inf"))
            empty = empty | (j > i).all(dim=1)
        logits = logits.masked_fill(empty[:, None], 0.0)  # rows that see nothing: no NaN, zeroed below
        row_lse = torch.logsumexp(logits, dim=-1)  # (H, Lq)
        probs = torch.exp(logits - row_lse[..., None]) * (~empty)[:, None].float()
        out = torch.einsum("hqk,khd->qhd", probs.to(q.dtype).float(), v.float()[:, kv_head])
        lse = torch.where(empty, torch.full_like(row_lse, float("-inf")), row_lse)
        return out.to(q.dtype).contiguous(), lse  # the kernel writes a contiguous (Lq, H, D_v) output

    def _backward_rules(self, entry: str, q, k, v, out):
        """``out``, made to fail at its backward pass where the real backward kernel would."""
        message = backward_refusal(q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2], self.arch)
        if message is None or not out.requires_grad:
            return out
        return _RefuseBackward.apply(out, f"FlashAttention-4 backward of {entry} (SM{self.arch})", message)

    @staticmethod
    def _wants_lse(return_lse, *tensors) -> bool:
        return return_lse or any(t.requires_grad for t in tensors)

    # ---- flash_attn_func ------------------------------------------------------------------------------
    def flash_attn_func(
        self,
        q,
        k,
        v,
        qv=None,
        gather_kv_indices=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        aux_tensors=None,
        aux_scalars=None,
        block_sparse_tensors=None,
        block_sparse_tensors_bwd=None,
        return_lse=False,
        gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ):
        self.calls.append("flash_attn_func")
        options = dict(locals())
        entry = "flash_attn_func"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise self._refuse(entry, "flash_attn_func takes (batch, seqlen, nheads, headdim) tensors")
        self._check(entry, q, k, v, options)
        if k.shape[0] != q.shape[0]:
            got = f"q {tuple(q.shape)}, k {tuple(k.shape)}"
            raise self._refuse(entry, "q and k/v must have the same batch size", got)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        results = [self._one(q[b], k[b], v[b], scale, causal) for b in range(q.shape[0])]
        out = torch.stack([r[0] for r in results])
        lse = torch.stack([r[1] for r in results]) if self._wants_lse(return_lse, q, k, v) else None
        return self._backward_rules(entry, q, k, v, out), lse

    # ---- flash_attn_varlen_func -----------------------------------------------------------------------
    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        gather_kv_indices=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        block_sparse_tensors=None,
        aux_tensors=None,
        aux_scalars=None,
        return_lse=False,
        scheduler_metadata=None,
        seqlen_k_per_split=None,
        disable_scheduler_metadata=False,
        gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ):
        self.calls.append("flash_attn_varlen_func")
        options = dict(locals())
        entry = "flash_attn_varlen_func"
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise self._refuse(entry, "flash_attn_varlen_func takes packed (total, nheads, headdim) tensors")
        self._check(entry, q, k, v, options)
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise NotImplementedError("flash4 stand-in: varlen needs cu_seqlens_q and cu_seqlens_k")
        batch = cu_seqlens_q.shape[0] - 1
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32:
                rule = "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
                raise self._refuse(entry, rule, f"{name} {cu.dtype}")
            if cu.shape != (batch + 1,):
                got = f"{name} of shape {tuple(cu.shape)}, batch {batch}"
                raise self._refuse(entry, f"{name} must have shape (batch_size + 1,)", got)
            if cu.stride(0) != 1:
                rule = "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
                raise self._refuse(entry, rule, f"{name} of stride {cu.stride(0)}")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        wants_lse = self._wants_lse(return_lse, q, k, v)
        if cu_seqlens_q.is_meta or cu_seqlens_k.is_meta:  # no lengths: all packed tokens as one sequence
            out, lse = self._one(q, k, v, scale, causal)
            return self._backward_rules(entry, q, k, v, out), lse if wants_lse else None
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if bq[0] != 0 or bk[0] != 0 or bq[-1] != q.shape[0] or bk[-1] != k.shape[0]:
            rule = "cu_seqlens must start at 0 and end at the number of packed tokens"
            raise self._refuse(entry, rule, f"cu_seqlens_q {bq}, cu_seqlens_k {bk}")
        len_q = [b - a for a, b in zip(bq, bq[1:])]
        len_k = [b - a for a, b in zip(bk, bk[1:])]
        if min(len_q + len_k) < 0:
            raise self._refuse(entry, "cu_seqlens must not decrease", f"cu_seqlens_q {bq}, cu_seqlens_k {bk}")
        for bound, lengths in ((max_seqlen_q, len_q), (max_seqlen_k, len_k)):
            if bound is not None and max(lengths) > bound:
                rule = "a sequence is longer than max_seqlen_q / max_seqlen_k"
                raise self._refuse(entry, rule, f"a length of {max(lengths)}, max_seqlen {bound}")
        self.varlen.append((len_q, len_k))
        results = [
            self._one(q[bq[b] : bq[b + 1]], k[bk[b] : bk[b + 1]], v[bk[b] : bk[b + 1]], scale, causal)
            for b in range(batch)
        ]
        out = torch.cat([r[0] for r in results])
        lse = torch.cat([r[1] for r in results], dim=1) if wants_lse else None
        return self._backward_rules(entry, q, k, v, out), lse

    # ---- injection --------------------------------------------------------------------------------------
    def as_modules(self) -> dict[str, types.ModuleType]:
        """``flash_attn.cute`` and ``flash_attn.cute.interface`` module objects exposing the functions."""
        interface = types.ModuleType("flash_attn.cute.interface")
        interface.__doc__ = "stand-in for flash-attn-4 (goat_dist/kernels/flash4_standin.py)"
        cute = types.ModuleType("flash_attn.cute")
        functions = {
            "flash_attn_func": self.flash_attn_func,
            "flash_attn_varlen_func": self.flash_attn_varlen_func,
        }
        vars(interface).update(functions)
        vars(cute).update(functions, __version__="4.standin", interface=interface)
        return {"flash_attn.cute": cute, "flash_attn.cute.interface": interface}


def fa2_cute_interface() -> types.ModuleType:
    """The ``flash_attn.cute.interface`` the FlashAttention-2 sdist installs: the same two names, an
    older signature (flash-attn 2.8.3.post2's ``flash_attn/cute/interface.py``), no ``return_lse``."""
    interface = types.ModuleType("flash_attn.cute.interface")
    interface.__file__ = "site-packages/flash_attn/cute/interface.py"

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, softcap=0.0, pack_gqa=None):  # fmt: skip
        raise AssertionError("FlashAttention-2's flash_attn.cute was called")

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                               seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0,
                               pack_gqa=None):  # fmt: skip
        raise AssertionError("FlashAttention-2's flash_attn.cute was called")

    vars(interface).update(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
    return interface


@contextlib.contextmanager
def installed(
    standin: Flash4Standin | None = None,
    capability: tuple[int, int] | None = None,
    *,
    arch: int | None = None,
):
    """Make ``flash_attn.cute.interface`` import as ``standin`` (default: a strict ``Flash4Standin``
    playing ``arch``, 90 unless given) and let ``goat_dist`` use it without CUDA; yields the stand-in.

    The project imports FA4 lazily (``goat_dist.kernels.flash_imports._flash_attn_cute``, cached): the
    cache is cleared on entry and exit, so a real install is seen again afterwards. The device the
    project queries (``kernels.backend.device_capability``) plays a GPU of ``capability`` (default: the
    stand-in's ``arch``) for the duration, so ``resolve_backend("auto")`` picks flash4 there.
    """
    from . import backend, flash_imports

    if standin is None:
        standin = Flash4Standin(arch=90 if arch is None else arch)
    elif arch is not None and arch != standin.arch:
        raise ValueError(f"installed(arch={arch}) with a stand-in playing SM{standin.arch}: give one of them")
    major, minor = capability or divmod(standin.arch, 10)
    saved = {name: sys.modules.get(name) for name in ("flash_attn.cute", "flash_attn.cute.interface")}
    sys.modules.update(standin.as_modules())
    flash_imports._flash_attn_cute.cache_clear()
    original = backend.device_capability
    backend.device_capability = lambda device=None: (major, minor)
    try:
        yield standin
    finally:
        backend.device_capability = original
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        flash_imports._flash_attn_cute.cache_clear()
