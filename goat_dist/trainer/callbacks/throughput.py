"""The logged step's metrics (``on_log``: loss, learning rate, gradient norm, throughput, MFU, memory,
epoch) every ``log.interval`` steps, at the first and the last step and at every dropped update.

Throughput is measured over a window of steps since the last log; evaluation, pictures and saves are not
training time: whatever the other callbacks do after this one at a step boundary (``order``) is left out
of the window, up to the next step's start."""

from __future__ import annotations

import dataclasses
import time

from .base import Callback


class Throughput(Callback):
    order = 10  # first at a step boundary: the log line comes before evaluation and checkpoints

    def __init__(self, cfg):
        self.cfg = cfg
        self.observed = None
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0
        self.paused_at: float | None = None  # when this step boundary's other work began
        self.lr = 0.0

    def on_train_start(self, state, info):
        from ...observe.step_metrics import StepMetrics

        api = self.trainer
        # weights are replicated (and ZeRO-3-partitioned) over DP x CP: the norm counts each replica once
        replicas = dataclasses.replace(api.layout, dp=api.layout.replicas, dp_rank=api.layout.replica_rank)
        self.observed = StepMetrics(self.cfg, api.model, replicas, api.data.dataset)
        self.window_start, self.window_steps, self.paused_at = time.perf_counter(), 0, None
        self.window_tokens = state.consumed_tokens  # the window's tokens: what the steps consumed

    def pre_step(self, state):
        if self.paused_at is not None:  # the last step boundary's evaluation, pictures, saves
            self.window_start += time.perf_counter() - self.paused_at
            self.paused_at = None
        self.lr = self.trainer.lr  # the rate this step uses

    def post_step(self, state, control):
        api = self.trainer
        self.window_steps += 1
        every = self.cfg.log.interval
        last = state.step == self.cfg.train.max_steps
        if state.step % every == 0 or last or state.step == 1 or control.dropped:
            seconds = time.perf_counter() - self.window_start
            tokens_per_s = (state.consumed_tokens - self.window_tokens) / seconds  # ramp-up: sizes vary
            state.metrics = {
                "data_fingerprint": control.fingerprint,
                "data_skipped": state.data_skipped,
                "nonfinite_skipped": state.nonfinite_skipped,
                "unreadable_skipped": state.unreadable_skipped,
                # NaN: a non-finite loss, or no loss at all (no readable label)
                "loss": float("nan") if control.nonfinite_loss or control.unreadable else control.loss,
                "lr": self.lr,
                "grad_norm": api.grad_norm,
                "tokens_per_s": tokens_per_s,
                # params norm, MFU, memory, epoch: one all-gather, at log steps only
                **self.observed.collect(state, seconds / self.window_steps, tokens_per_s),
            }
            api.emit("on_log", state.metrics)
            self.window_start, self.window_steps = time.perf_counter(), 0
            self.window_tokens = state.consumed_tokens
        self.paused_at = time.perf_counter()
