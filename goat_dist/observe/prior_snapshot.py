"""The learned GOAT prior as numbers a picture can be drawn from: K_rel(d), u(j) and the log-prior matrix.

Why from the module's public methods only (``GoatPrior.log_prior`` / ``sink``, the explicit form the
``eager`` kernel uses) and not from a re-derivation of the formula: the pictures then show whatever the
model computes, whatever the lanes' implementation. The relative term is read off the explicit matrix:
with positions ``(0, d)`` and no causal recency, ``K[1, 0] = K_rel(d) + u(0)``.

Under tensor parallelism each rank owns some KV heads; every rank computes its own and the model's TP
group (``model.tp_group``, its ``layout``'s) gathers them to its first rank (a collective, only at
``log.prior_interval`` steps). Under ZeRO-3 the prior's parameters are gathered for the moment
(``engine.zero3.gathered``; they are tiny and normally persistent anyway).
"""

from __future__ import annotations

import torch

from .. import collectives
from ..engine.zero3 import gathered

REACH = 4  # curves extend to REACH x the training length: extrapolation is the point
GRID = 128  # the heatmap samples GRID positions over twice the training length


def chosen_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """``log.prior_layers`` (negative indices count from the end), default first, middle and last."""
    if requested is None:
        return sorted({0, num_layers // 2, num_layers - 1})
    out = []
    for i in requested:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"log.prior_layers: layer {i} does not exist (model.num_layers={num_layers})")
        out.append(i % num_layers)
    return sorted(set(out))


@torch.no_grad()
def prior_curves(prior, train_len: int, reach: int = REACH, grid: int = GRID) -> dict[str, torch.Tensor]:
    """This module's heads (first dim): ``k_rel`` (H, N) over distance 0..reach*L, ``sink`` (H, N) u(j)
    without the causal recency term, ``slope`` (H,) that term's slope, ``log_prior`` (H, n, n) on a
    ``grid`` of positions over [0, 2L), row-centred (max 0 over allowed keys, -inf above the diagonal)."""
    device = next(prior.parameters()).device
    d = torch.arange(reach * train_len + 1, device=device)
    pairs = torch.stack([torch.zeros_like(d), d], dim=1)  # row b: key at 0, query at d
    k_rel = prior.log_prior(pairs, False)[:, :, 1, 0]  # (N, H) = K_rel(d) + u(0)
    heads = k_rel.shape[1]
    sink = torch.zeros(heads, d.numel(), device=device)
    slope = torch.zeros(heads, device=device)
    if prior.key_bias:
        sink = prior.sink(d[None], False)[0].T.float()
        k_rel = k_rel - sink[:, 0]
        two = d[None, :2]
        recency = prior.sink(two, True) - prior.sink(two, False)  # slope * (t - origin)
        slope = (recency[0, 1] - recency[0, 0]).float()
    positions = torch.linspace(0, 2 * train_len - 1, min(grid, 2 * train_len), device=device).round().long()
    matrix = prior.log_prior(positions[None], True)[0].float()  # (H, n, n)
    allowed = torch.ones(positions.numel(), positions.numel(), dtype=torch.bool, device=device).tril()
    matrix = matrix.masked_fill(~allowed, float("-inf"))
    matrix = matrix - matrix.amax(dim=-1, keepdim=True)
    return {
        "k_rel": k_rel.T.float().contiguous(),
        "sink": sink.contiguous(),
        "slope": slope,
        "log_prior": matrix.contiguous(),
        "distance": d.float(),
        "positions": positions.float(),
    }


def _gather_heads(curves: dict[str, torch.Tensor], tp: int, group) -> dict[str, torch.Tensor]:
    """Concatenate every TP rank's heads (first dim of the per-head tensors) in rank order: ``tp`` ranks
    in ``group`` (the model's TP group)."""
    if tp == 1:
        return curves
    out = dict(curves)
    for key in ("k_rel", "sink", "slope", "log_prior"):
        out[key] = torch.cat(collectives.all_gather(curves[key], group=group))
    return out


def prior_snapshot(model, layers: list[int] | None, heads: list[int] | None, step: int) -> dict | None:
    """Curves of the chosen layers and KV heads as numpy arrays on the TP group's first rank (None on the
    others, and everywhere for a model without a GOAT prior). Collective over the model's TP group
    (``model.layout``'s)."""
    blocks = model.blocks
    if getattr(blocks[0].attn, "prior", None) is None:
        return None
    train_len = blocks[0].attn.prior.training_seq_len
    sync = getattr(model, "sync_prior_masters", None)  # ZeRO-3 + bf16: the fp32 values (engine/zero3.py)
    if sync is not None:
        sync()
    layout = model.layout
    snapshot = {"step": step, "train_len": train_len, "layers": {}}
    for layer in chosen_layers(layers, len(blocks)):
        prior = blocks[layer].attn.prior
        with gathered(prior):
            curves = _gather_heads(prior_curves(prior, train_len), layout.tp, model.tp_group)
        total = curves["k_rel"].shape[0]
        keep = list(range(total)) if heads is None else [h for h in heads if 0 <= h < total]
        if heads is not None and len(keep) != len(heads):
            raise ValueError(f"log.prior_heads={heads}: the model has {total} KV heads")
        picked = {
            k: (v[keep] if k in ("k_rel", "sink", "slope", "log_prior") else v) for k, v in curves.items()
        }
        snapshot["layers"][layer] = {k: v.cpu().numpy() for k, v in picked.items()}
        snapshot["heads"] = keep
    return snapshot if layout.tp_rank == 0 else None
