"""Pictures of the GOAT prior (``observe.prior_snapshot``) every ``log.prior_interval`` steps and at the
last step (so a run shorter than the interval, the default one among them, still shows its prior), for
TensorBoard (``on_prior``). Collective over the TP group; pictures drawn on the main rank."""

from __future__ import annotations

import time

from .base import Callback


class PriorPictures(Callback):
    order = 30

    def __init__(self, cfg):
        self.cfg, self.log = cfg, cfg.log

    def post_step(self, state, control):
        from ...observe.prior_snapshot import prior_snapshot

        log, api = self.log, self.trainer
        last = state.step == self.cfg.train.max_steps
        if not (log.tensorboard and log.prior_interval and (state.step % log.prior_interval == 0 or last)):
            return
        started = time.perf_counter()
        snapshot = prior_snapshot(api.model, log.prior_layers, log.prior_heads, state.step)
        if snapshot is not None and api.layout.is_main:
            from ...observe.figures import prior_images

            images = prior_images(snapshot)
            api.emit("on_prior", {"images": images, "seconds": time.perf_counter() - started})
