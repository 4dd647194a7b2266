"""Non-finite losses and gradients: detection, a dropped update, and an error that says where.

``train.on_nonfinite=raise`` stops at the first step whose loss or gradients hold a NaN/Inf, naming the
step, the data (source, shard and global sample) of the offending micro-batch and the first parameter
with a non-finite gradient. ``skip`` drops that step's update: no optimizer step and no LR-schedule
step, under every ZeRO stage (``goat_dist.engine.steps``: the detection on this rank's reduced gradients
and the dropped update both depend on where the engine keeps them).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import collectives
from ..engine.zero3 import local_values

__all__ = [
    "NonFiniteError",
    "describe_sample",
    "first_nonfinite_weight",
    "raise_nonfinite",
]


class NonFiniteError(RuntimeError):
    """A loss, gradient or weight is NaN/Inf; the message names the step, the data and the parameter."""


# ---- detection ---------------------------------------------------------------------------------------
def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """Name of the first parameter whose local values (a ZeRO-3 partition included) are NaN/Inf.

    A ZeRO-3 partition is read up to its real elements: its padding is uninitialised memory."""
    for name, p in model.named_parameters():
        local = local_values(p)
        if not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


# ---- where the data came from ------------------------------------------------------------------------
def describe_sample(dataset, n: int) -> str:
    """Source, epoch, shard(s) and window of global sample ``n`` of a ``PackedBatches`` stream."""
    from ..data.schedule import Mixture

    s, j = Mixture([src.weight for src in dataset.sources], dataset.seed).locate(n)
    source, schedule = dataset.sources[s], dataset.schedules[s]
    epoch, _, window = schedule.locate(j)
    order = schedule.shard_order(epoch)
    ends = np.cumsum([source.n_tokens[i] for i in order])
    first, last = window * schedule.seq_len, window * schedule.seq_len + schedule.seq_len
    a = int(np.searchsorted(ends, first, side="right"))
    b = int(np.searchsorted(ends, last, side="right"))
    shards = [source.shards[order[i]].rsplit("/", 1)[-1] for i in range(a, min(b, len(order) - 1) + 1)]
    return (
        f"global sample {n} (source {source.path}, shard {', '.join(shards)}, epoch {epoch}, window {window})"
    )


def raise_nonfinite(engine, step: int, control, samples: list[int], dataset, reason: str = "") -> None:
    """Collective on the error path: agree on the offending data and parameter, then raise on every rank.

    ``engine``: the ``goat_dist.engine.Engine`` (which names the parameter); ``samples``: the global samples
    of this rank's first micro-batch with a non-finite loss (or [])."""
    first = torch.tensor([samples[0] if samples else -1], dtype=torch.long)
    gathered = collectives.all_gather(first)
    offending = [(rank, int(t)) for rank, t in enumerate(gathered) if int(t) >= 0]
    param = engine.first_nonfinite_gradient()
    what = "loss" if control.nonfinite_loss else "gradient"
    parts = [f"step {step}: non-finite {what}" + (f" ({reason})" if reason else "")]
    if offending:
        rank, n = offending[0]
        try:
            where = describe_sample(dataset, n)
        except (AttributeError, IndexError, ValueError):  # a generated source has no shards to name
            where = f"global sample {n} ({type(dataset).__name__})"
        parts.append(f"the micro-batch on rank {rank} starting at {where}")
    parts.append(f"first parameter with a non-finite gradient: {param}" if param else "all gradients finite")
    if not reason:
        parts.append("set train.on_nonfinite=skip to drop such updates instead")
    raise NonFiniteError("; ".join(parts))
