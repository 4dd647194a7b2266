"""Build a ``GoatSelfAttention`` from the authors' reference ``goat.attention.GoatAttention``.

The reference projects q and k to the full head dim and then drops their last ``2R+1`` lanes; only the
content rows are copied, into the grouped fused layout of ``split_grouped_qkv``. The converted module
keeps the reference's content dim ``D - 2R - 1``. By default (``key_lanes=None``) its u(j) takes as many
lanes as the kernel dtype needs: one in fp32, so q/k are the reference's D wide with no padding lane;
three in bf16/fp16 (exact there, where the reference's single lane is not), q/k then two lanes wider
than v (the flash path pads v; sdpa and eager take unequal head dims).
"""

from __future__ import annotations

import torch

from .module import GoatSelfAttention


def _reference_projections(ref) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """(Wq, Wk, Wv) and their biases (or Nones) from a fused or separate reference module."""
    if ref.in_proj is not None:
        E, kvE = ref.embed_dim, ref.kv_embed_dim
        weights = ref.in_proj.weight.split([E, kvE, kvE])
        biases = ref.in_proj.bias.split([E, kvE, kvE]) if ref.in_proj.bias is not None else [None] * 3
        return *weights, list(biases)
    layers = (ref.q_proj, ref.k_proj, ref.v_proj)
    return *(m.weight for m in layers), [m.bias for m in layers]


@torch.no_grad()
def from_reference(ref, backend: str = "auto", key_lanes: int | None = None) -> GoatSelfAttention:
    """A ``GoatSelfAttention`` computing the same function as ``ref`` (1-D positions, self-attention).

    ``key_lanes``: u(j)'s lanes (``GoatPrior``); None follows the dtype (module docstring), 1 is the
    reference's own layout in every dtype, 3 keeps u(j) exact in bf16 at a fixed q/k width of D + 2.

    Unsupported reference features (bias_kv, zero_attn, prior gate, 2-D positions, cross-attention
    dims, a prior scale other than 1) raise instead of being silently dropped.
    """
    unsupported = {
        "add_bias_kv": ref.add_bias_kv,
        "add_zero_attn": ref.add_zero_attn,
        "prior_gate": ref.prior_gate != "none",
        "pos_encoding=2d": ref.pos_encoding == "2d",
        "kdim/vdim": ref.kdim != ref.embed_dim or ref.vdim != ref.embed_dim,
        "goat_prior_scale": float(ref.goat_prior_scale) != 1.0,
        "dropout": ref.dropout != 0.0,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"from_reference: unsupported reference features {bad}")
    if ref.enable_key_bias and ref.training_seq_len is None:
        raise ValueError("from_reference: the reference needs training_seq_len set (u(j) normalisation)")
    wq, wk, wv, (bq, bk, bv) = _reference_projections(ref)
    mod = GoatSelfAttention(
        ref.embed_dim,
        ref.num_heads,
        ref.kv_num_heads,
        ref.R,
        ref.M,
        pos_base=_base(ref.rel_freqs_base, ref.R),
        abs_base=_base(ref.abs_freqs_base, ref.M),
        key_bias=ref.enable_key_bias,
        training_seq_len=ref.training_seq_len or 1,
        prior_init=ref.prior_init,
        bias=bq is not None,
        backend=backend,
        content_dim=ref.content_dim,
        key_lanes=key_lanes,
    ).to(device=wq.device)
    H, G, D, dc = ref.num_heads, ref.kv_num_heads, ref.head_dim, ref.content_dim
    group = H // G

    def fused(tensors_q, tensor_k, tensor_v):
        q = tensors_q.view(G, group, D, *tensors_q.shape[1:])[:, :, :dc].reshape(G, group * dc, -1)
        k = tensor_k.view(G, D, *tensor_k.shape[1:])[:, :dc].reshape(G, dc, -1)
        v = tensor_v.view(G, D, -1)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tensors_q.shape[1:])

    mod.qkv.weight.copy_(fused(wq, wk, wv))
    if bq is not None:
        mod.qkv.bias.copy_(fused(bq[:, None], bk[:, None], bv[:, None]).squeeze(-1))
    mod.out_proj.weight.copy_(ref.out_proj.weight)
    if ref.out_proj.bias is not None:
        mod.out_proj.bias.copy_(ref.out_proj.bias)
    p = mod.prior
    p.rel_freqs.copy_(ref.rel_freqs_base)
    p.abs_freqs.copy_(ref.abs_freqs_base)
    if p.pos_rank > 0:
        p.lambda_sym.copy_(ref.lambda_sym)
        p.lambda_asym.copy_(ref.lambda_asym)
    if ref.enable_key_bias:
        if p.sink_mlp is not None:
            p.sink_mlp.load_state_dict(ref.key_bias.state_dict())
            p.sink_gain.copy_(ref.sink_gain)
        p.sink_bump.copy_(ref.sink_bump)
        p.recency_slope_raw.copy_(ref.recency_slope_raw)
    return mod


def _base(freqs: torch.Tensor, rank: int) -> float:
    """Recover ``base`` from ``freqs = base ** (-r / (rank - 1))``: the last frequency is ``1/base``."""
    if rank < 2:
        return 10_000.0  # a single frequency is 1 whatever the base
    return float(f"{1.0 / float(freqs[-1]):.6g}")
