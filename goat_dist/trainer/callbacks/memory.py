"""Per-rank bytes of parameters, gradients and optimizer state (``on_memory``), measured once: right
before the optimizer step of the loop's second step, where gradients and optimizer state coexist (the
peak; the first step creates the optimizer state). A dropped update is not measured."""

from __future__ import annotations

import torch

from ... import collectives
from ...engine.memory import training_state_bytes
from .base import Callback


class MemoryUse(Callback):
    order = 10

    def pre_optim_step(self, state, control):
        t = self.trainer
        if not control.dropped and state.step == t.loop.first_step + 1:
            t.emit("on_memory", measure(t.engine))


def measure(engine) -> dict:
    """Collective: every rank's bytes per kind (``training_state_bytes``), gathered on every rank."""
    local = training_state_bytes(engine.module, engine.optimizer)
    keys = sorted(local)
    gathered = collectives.all_gather(torch.tensor([local[k] for k in keys]))
    return {k: [int(g[i]) for g in gathered] for i, k in enumerate(keys)}
