"""Perplexity at several evaluation lengths, on non-overlapping fresh windows.

Protocol (stated in every result): the split's documents are packed into one token stream, as the
training loader packs them, and cut into **non-overlapping windows** of ``length`` tokens (window ``w``
predicts tokens ``w*length + 1 .. (w+1)*length``). Every window is evaluated **fresh**: positions
``0 .. length-1``, no context carried over from the previous window, so a window's early tokens have
short contexts and the perplexity at a length averages over contexts ``0 .. length-1``. Every length
reads the same first ``tokens`` tokens of the stream (``tokens // length`` windows, capped so no window
repeats). ``loss_by_position`` splits the loss by position inside the window in blocks of the training
length: the blocks past the first are exactly the extrapolated positions. A model trained on BOS-framed
windows (``data.bos_framing``) is evaluated on them: window ``w`` is a BOS and the corpus tokens
``w*(length-1) .. (w+1)*(length-1) - 1``, predicting those and the next one (``data/framing.py``).

Tensor parallelism: under torchrun every TP rank computes its vocabulary slice and the cross-entropy is
vocab-parallel over the model's TP group; data-parallel ranks (world / TP, the model's ``layout``) split
the windows and sum. Context parallelism (one
window split over ranks, for lengths beyond one device's memory) does not exist in goat-dist yet.
"""

from __future__ import annotations

import math

import torch

from .. import collectives
from ..data import framing
from ..data.loader import IGNORE_INDEX, PackedBatches
from ..data.sources import resolve_sources
from ..model.loss import vocab_parallel_cross_entropy
from . import EvalError

PROTOCOL = (
    "non-overlapping windows of each length over the split's packed token stream, each evaluated from an "
    "empty context (positions 0..length-1); loss over every predicted token"
)


def check_length(cfg, length: int) -> None:
    """Learned absolute positions have a table of ``seq_len`` rows: nothing beyond it exists."""
    if cfg.position == "learned" and length > cfg.seq_len:
        raise EvalError(
            f"model.position=learned cannot extrapolate: its position table has {cfg.seq_len} entries "
            f"(the training length), so evaluation length {length} is impossible; "
            f"use lengths <= {cfg.seq_len}"
        )
    if length < 2:
        raise EvalError(f"evaluation lengths must be >= 2, got {length}")


def token_losses(model, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (b, s) in fp32, vocab-parallel under TP (a collective over the model's TP
    group, ``model.tp_group``)."""
    logits = model(tokens, positions)  # (b, s, V / tp), padded columns -inf
    losses = vocab_parallel_cross_entropy(
        logits.float().transpose(0, 1).contiguous(),
        labels.clamp(min=0).transpose(0, 1).contiguous(),
        model.tp_group,
    )
    return losses.transpose(0, 1) * (labels != IGNORE_INDEX)


@torch.no_grad()
def perplexity_at(
    model,
    data_path: str,
    split: str,
    length: int,
    tokens: int,
    batch_tokens: int,
    device: torch.device,
    autocast,
    train_len: int,
    bos_framing: bool = False,
) -> dict:
    """One evaluation length; collective over the world (every rank calls it with the same arguments): the
    model's ``layout`` says how its DP ranks split the windows. ``bos_framing``: each window is a BOS and
    ``length - 1`` corpus tokens, as the model was trained (``data.bos_framing``, ``data/framing.py``); the
    BOS is position 0 and predicts the first token."""
    check_length(model.cfg, length)
    layout = model.layout
    dp, dp_rank = layout.dp, layout.dp_rank
    micro = max(1, batch_tokens // length)
    sources = resolve_sources([{"path": data_path, "weight": 1.0}], split)
    available = (sources[0].total_tokens - 1) // framing.stride(length, bos_framing)
    if available < 1:
        raise EvalError(
            f"{data_path} ({split}) holds {sources[0].total_tokens} tokens: not one window of {length + 1}"
        )
    windows = min(tokens // length, available)
    if windows < 1:
        raise EvalError(f"--tokens {tokens} is less than one window of length {length}")
    dataset = PackedBatches(
        sources, length, micro, dp_rank=dp_rank, dp_size=dp, seed=0, shuffle=False, bos_framing=bos_framing
    )
    by_position = torch.zeros(length, dtype=torch.float64)
    counts = torch.zeros(length, dtype=torch.float64)
    steps = math.ceil(windows / (micro * dp))  # equal on every rank: TP peers must run the same batches
    for k, batch in zip(range(steps), dataset):
        keep = torch.tensor([n < windows for n in dataset.global_samples(k)])
        labels = batch["labels"].masked_fill(~keep[:, None], IGNORE_INDEX)
        with autocast():
            losses = token_losses(
                model, batch["tokens"].to(device), batch["position_ids"].to(device), labels.to(device)
            )
        valid = (labels != IGNORE_INDEX).double()
        by_position += losses.double().cpu().sum(0)
        counts += valid.sum(0)
    totals = torch.stack([by_position, counts])
    collectives.all_reduce(totals, group=layout.dp_group)
    by_position, counts = totals
    loss = float(by_position.sum() / counts.sum())
    blocks = []
    for start in range(0, length, train_len):
        end = min(start + train_len, length)
        blocks.append(
            {
                "start": start,
                "end": end,
                "loss": float(by_position[start:end].sum() / counts[start:end].sum()),
            }
        )
    return {
        "length": length,
        "multiple": length / train_len,
        "windows": windows,
        "bos_framing": bos_framing,
        "tokens": int(counts.sum()),
        "loss": loss,
        "ppl": math.exp(min(loss, 700.0)),
        "loss_by_position": blocks,
    }
