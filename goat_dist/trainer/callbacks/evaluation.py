"""Validation every ``train.eval_interval`` steps and at the last step; with ``log.attention_stats`` the
first batch's forward pass also measures attention per layer (``observe.attention_stats``)."""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state

from ... import collectives
from .base import Callback


class Evaluation(Callback):
    order = 20  # after the step's log line, before pictures and checkpoints

    def __init__(self, trainer):
        self.attach(trainer)
        self.interval = trainer.cfg.train.eval_interval
        self.attention_stats: dict | None = None

    def post_step(self, state, control):
        t = self.trainer
        last = state.step == t.cfg.train.max_steps
        if self.interval and (state.step % self.interval == 0 or last):
            val_loss = self.evaluate()
            ppl = math.exp(min(val_loss, 700))
            t.emit("on_eval", {"val_loss": val_loss, "val_ppl": ppl, **(self.attention_stats or {})})

    @torch.no_grad()
    def evaluate(self) -> float:
        """Collective: the mean validation loss over ``train.eval_batches`` (and ``attention_stats``)."""
        from ...observe.attention_stats import AttentionProbe

        t = self.trainer
        t.engine.eval()
        it = iter(t.val_batches)
        total = torch.zeros((), device=t.layout.device)
        n = t.cfg.train.eval_batches
        # the probe re-runs attention over whole rows: not under context parallelism
        stats = t.cfg.log.attention_stats and t.layout.cp == 1
        probe = AttentionProbe(t.engine.module) if stats else None
        for i in range(n):
            tokens, positions, labels, _ = t.batch(it)
            with t.autocast(), probe if (probe and i == 0) else contextlib.nullcontext():
                total += t.engine(tokens, positions, labels).float()
        # CP ranks' losses average to their rows' mean (model.gpt): reduce over DP x CP
        replicas = parallel_state.get_data_parallel_group(with_context_parallel=True)
        collectives.all_reduce(total, group=replicas)
        self.attention_stats = probe.result() if probe else None  # collective over TP
        t.engine.train()
        return total.item() / (n * t.layout.replicas)
