"""Bytes of parameters, gradients and optimizer state (``on_memory``), measured once: right before the
optimizer step of the loop's second step, where gradients and optimizer state coexist (the peak; the first
step creates the optimizer state). A dropped update is not measured.

The record is a summary over ranks (min / mean / max and the rank of the max per kind), so it stays the
same size at any world; every rank's bytes are added only with ``log.memory_per_rank``."""

from __future__ import annotations

import torch

from ... import collectives
from .base import Callback


class MemoryUse(Callback):
    order = 10

    def pre_optim_step(self, state, control):
        api = self.trainer
        if not control.dropped and state.step == api.first_step + 1:
            api.emit("on_memory", measure(api.state_bytes(), per_rank=bool(api.cfg.log.memory_per_rank)))


def measure(local: dict[str, int], per_rank: bool = False) -> dict:
    """Collective: every rank's bytes per kind (``local``: this rank's, ``Engine.state_bytes``), gathered
    on every rank and summarised (``summary``)."""
    keys = sorted(local)
    gathered = collectives.all_gather(torch.tensor([local[k] for k in keys]))
    return summary({k: [int(g[i]) for g in gathered] for i, k in enumerate(keys)}, per_rank)


def summary(per_rank_bytes: dict[str, list[int]], per_rank: bool = False) -> dict:
    """``{"bytes": {kind: {"min", "mean", "max", "max_rank"}}}`` over ranks (``max_rank``: the first rank
    holding the max), plus ``"bytes_per_rank"`` (the lists) when ``per_rank``."""
    out = {"bytes": {}}
    for kind, values in per_rank_bytes.items():
        top = max(values)
        out["bytes"][kind] = {
            "min": min(values),
            "mean": sum(values) / len(values),
            "max": top,
            "max_rank": values.index(top),
        }
    if per_rank:
        out["bytes_per_rank"] = per_rank_bytes
    return out
