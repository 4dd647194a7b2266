"""Validation every ``train.eval_interval`` steps and at the last step; with ``log.attention_stats`` the
first batch's forward pass also measures attention per layer (``observe.attention_stats``)."""

from __future__ import annotations

import contextlib
import math

import torch

from ... import collectives
from .base import Callback


class Evaluation(Callback):
    """Built with the config and this rank's validation batches (``val_batches``, None without
    ``train.eval_interval``); the model through the callbacks' API."""

    order = 20  # after the step's log line, before pictures and checkpoints

    def __init__(self, cfg, val_batches):
        self.cfg, self.val_batches = cfg, val_batches
        self.interval = cfg.train.eval_interval
        self.attention_stats: dict | None = None

    def post_step(self, state, control):
        last = state.step == self.cfg.train.max_steps
        if self.interval and (state.step % self.interval == 0 or last):
            val_loss = self.evaluate()
            ppl = math.exp(min(val_loss, 700))
            metrics = {"val_loss": val_loss, "val_ppl": ppl, **(self.attention_stats or {})}
            self.trainer.emit("on_eval", metrics)

    def evaluate(self) -> float:
        """Collective: the mean validation loss over ``train.eval_batches`` (and ``attention_stats``)."""
        from ...observe.attention_stats import AttentionProbe

        api = self.trainer
        with api.evaluating():
            it = iter(self.val_batches)
            total = torch.zeros((), device=api.layout.device)
            n = self.cfg.train.eval_batches
            # the probe re-runs attention over whole rows: not under context parallelism
            stats = self.cfg.log.attention_stats and api.layout.cp == 1
            probe = AttentionProbe(api.model) if stats else None
            for i in range(n):
                with probe if (probe and i == 0) else contextlib.nullcontext():
                    total += api.loss(next(it)).float()
            # CP ranks' losses average to their rows' mean (model.gpt): reduce over DP x CP (the replicas)
            collectives.all_reduce(total, group=api.layout.replica_group)
            self.attention_stats = probe.result() if probe else None  # collective over TP
        return total.item() / (n * api.layout.replicas)
