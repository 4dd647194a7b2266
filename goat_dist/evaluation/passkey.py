"""Passkey retrieval accuracy over a grid of (length, depth), see ``data.synthetic``.

A sample counts as retrieved when the model's greedy prediction of all ``DIGITS`` answer digits after
QUERY is right. With the true digits fed in (teacher forcing) one forward pass scores all five: when
every prediction is right, greedy decoding would have produced exactly these inputs, so the exact-match
count is the same as decoding's. Samples are a pure function of (seed, length, depth, index).

Tensor parallelism: logits are vocab-parallel; the answer positions' slices are gathered over the model's
TP group before the argmax. Data-parallel ranks (the model's ``layout``) split the samples of each cell.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import collectives
from ..data import synthetic
from .perplexity import check_length


def cell_samples(length: int, depth: float, count: int, seed: int) -> np.ndarray:
    """(count, length + 1) sequences of one grid cell."""
    rows = []
    for i in range(count):
        rng = np.random.default_rng([seed, length, int(round(depth * 1e6)), i])
        rows.append(synthetic.passkey_sequence(length, depth, rng))
    return np.stack(rows)


def full_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    """Gather vocab-parallel logits (..., V / tp) into (..., V) on every rank of ``group`` (the model's TP
    group, ``model.tp_group``; None or a group of one: the logits are already whole)."""
    if group is None or group.size() == 1:
        return logits
    parts = collectives.all_gather(logits, group=group)
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def retrieval_accuracy(
    model, length: int, depth: float, count: int, seed: int, batch_tokens: int, device: torch.device, autocast
) -> dict:
    """Exact-match and per-digit accuracy of one cell; collective over the world (the model's ``layout``:
    its DP ranks split the samples, its TP group gathers the logits)."""
    check_length(model.cfg, length)
    layout = model.layout
    dp, dp_rank = layout.dp, layout.dp_rank
    mine = cell_samples(length, depth, count, seed)[dp_rank::dp]
    micro = max(1, batch_tokens // length)
    exact = digits = 0
    steps = math.ceil(math.ceil(count / dp) / micro)  # batches per rank, equal on every rank
    answer = synthetic.answer_positions(length)
    for k in range(steps):
        chunk = mine[k * micro : (k + 1) * micro]
        if len(chunk) == 0:  # this rank ran out; TP peers still need the collective
            chunk = cell_samples(length, depth, 1, seed)
            weight = 0
        else:
            weight = 1
        tokens = torch.from_numpy(chunk[:, :length]).to(device)
        positions = torch.arange(length, device=device).expand_as(tokens)
        with autocast():
            logits = model(tokens, positions)[:, answer]
        predicted = full_vocab(logits.float(), model.tp_group)[..., : model.vocab_size].argmax(-1).cpu()
        target = torch.from_numpy(chunk[:, length + 1 - synthetic.DIGITS :])
        hits = predicted == target
        exact += weight * int(hits.all(-1).sum())
        digits += weight * int(hits.sum())
    totals = torch.tensor([exact, digits], dtype=torch.float64)
    collectives.all_reduce(totals, group=layout.dp_group)
    return {
        "length": length,
        "depth": depth,
        "samples": count,
        "accuracy": float(totals[0]) / count,
        "digit_accuracy": float(totals[1]) / (count * synthetic.DIGITS),
    }
