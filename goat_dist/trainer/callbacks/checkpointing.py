"""Checkpoint policy: when the run saves (what ``trainer_state.json`` holds is the trainer's record).

A checkpoint is saved at a step boundary when

* ``checkpoint.interval`` steps divide the step;
* ``checkpoint.interval_minutes`` passed since the last save (rank 0's clock: a save request);
* the deadline is near (``deadline.py``, rank 0's clock: a stop request, reason ``deadline``);
* a stop signal arrived, or a callback asked for a save or a stop (``Trainer.request_save/stop``);

and at the end of the run (``checkpoint.save_at_end``, unless this run already saved its last step).
Clock-based requests are made on rank 0 only, in ``post_backward``: they travel in that step's one
collective, so every rank saves at the same boundary. A stop's checkpoint, and the end-of-run one, are
published before the loop goes on; with ``checkpoint.async`` the others are published at a later step
boundary once every rank's background writes are done (``CheckpointManager.poll``).

At the start of training each node's first rank compares the next checkpoint's estimated size (the
doctor's ``next_checkpoint_bytes``) with the bytes free under run.dir: without room for one, every rank
stops before the first step (exit 2); without room for what ``checkpoint.keep_last`` keeps of this run's
saves, rank 0 prints a warning (``CheckpointManager.check_room``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml

from ... import collectives
from .. import nonfinite
from .base import Callback


class Checkpointing(Callback):
    """The checkpoint policy's job. Built by the trainer with what a save needs: ``checkpoints`` (the
    ``CheckpointManager``), ``engine`` (whose state is saved), ``record`` (a function returning what
    ``trainer_state.json`` holds: the run state, data contract, layout and callbacks' states) and the
    ``deadline``; the rest through the callbacks' API (``self.trainer``)."""

    order = 40  # after logging, evaluation and pictures at a step boundary; before the loggers end

    def __init__(self, cfg, checkpoints, engine, record, deadline):
        self.cfg, self.checkpoints, self.engine, self.record = cfg, checkpoints, engine, record
        self.policy = cfg.checkpoint
        self.save_at_end = cfg.checkpoint.save_at_end
        self.deadline = deadline  # Slurm's job end, train.stop_at or time_limit_minutes (None: none)
        self.last_save_time = time.monotonic()
        # the deadline budgets for the last save this run dir recorded (an earlier attempt's), else estimates
        self.last_save_s = checkpoints.previous_save_s()
        self.saved_step: int | None = None  # the step this run saved last

    # ---- policy -----------------------------------------------------------------------------------
    def on_train_start(self, state, info):
        self.check_room(state.step)
        self.last_save_time = time.monotonic()

    def check_room(self, start: int) -> None:
        """Collective: room under run.dir for this run's checkpoints (module docstring)."""
        from ...doctor.size import next_checkpoint_bytes

        layout = self.trainer.layout
        need = next_checkpoint_bytes(self.cfg)
        warning = self.checkpoints.check_room(need, self.planned_saves(start), layout.local_rank == 0)
        if warning and layout.is_main:
            print(warning, flush=True)

    def planned_saves(self, start: int) -> int | None:
        """The saves a run from step ``start`` makes by ``checkpoint.interval`` and at its end (None with
        ``checkpoint.interval_minutes``: no bound; a stop's save replaces the end's)."""
        if self.policy.interval_minutes:
            return None
        last, every = self.cfg.train.max_steps, self.policy.interval
        saves = last // every - start // every if every and last > start else 0
        if self.save_at_end and last > start and not (every and last % every == 0):
            saves += 1
        return saves

    def post_backward(self, state):
        """Rank 0's clock: a time-interval save, or the deadline's save and stop."""
        api = self.trainer
        if not api.layout.is_main:
            return
        minutes = self.policy.interval_minutes
        if minutes and (time.monotonic() - self.last_save_time) / 60 >= minutes:
            api.request_save()
        if self.deadline is not None and self.deadline.due(api.last_step_s, self.last_save_s):
            api.request_stop("deadline")

    def post_step(self, state, control):
        interval = self.policy.interval and state.step % self.policy.interval == 0
        self.finish_pending(wait=False)  # an asynchronous save whose writes are done is published
        if control.stop_reason or interval or control.save:
            self.save(final=bool(control.stop_reason))  # a stop waits until its checkpoint is published

    def on_train_end(self, state):
        # the end-of-run save depends on what this run saved, not on what the disk holds
        first = self.trainer.first_step
        if self.save_at_end and state.stop_requested is None and self.saved_step != state.step:
            if state.step > first:
                self.save(final=True)
        self.finish_pending(wait=True)  # an asynchronous save still in flight is published before exit

    # ---- saving -----------------------------------------------------------------------------------
    def save(self, final: bool = False) -> Path:
        """Collective. With ``checkpoint.async`` the state is staged in host memory and written in the
        background (published later by ``finish_pending``); ``final`` (a stop or the end of the run) waits
        until it is published. A pending save is published before the next one starts."""
        api, checkpoints = self.trainer, self.checkpoints
        self.finish_pending(wait=True)
        bad = nonfinite.first_nonfinite_weight(self.engine.module)
        flag = torch.tensor([0 if bad is None else 1])
        collectives.all_reduce(flag)
        if flag.item():
            raise nonfinite.NonFiniteError(
                f"step {api.step}: refusing to save a checkpoint from non-finite weights "
                f"({bad or 'on another rank'}); the previous checkpoint stays the latest"
            )
        record = self.record()
        config_text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        self.saved_step = api.step
        if self.policy.async_save:
            path = checkpoints.save_async(self.engine, record, config_text)
            self.last_save_time = time.monotonic()
            if final:
                self.finish_pending(wait=True)
            return path
        path = checkpoints.save(self.engine, record, config_text)
        self.last_save_time = time.monotonic()
        self.last_save_s = record["last_save_s"]
        api.emit("on_checkpoint", {"path": str(path), "save_s": record["last_save_s"]})
        return path

    def finish_pending(self, wait: bool) -> None:
        """Collective while an asynchronous save is pending (at every step boundary until it is published):
        publish it once every rank's writes are done, or, with ``wait``, wait for them now."""
        checkpoints = self.checkpoints
        pending = checkpoints.pending
        if pending is None:
            return
        path = checkpoints.wait() if wait else checkpoints.poll()
        if path is not None:
            self.last_save_s = checkpoints.last_save_s  # the deadline's estimate: staging to publish
            info = {"path": str(path), "save_s": checkpoints.last_save_s, "pause_s": pending.paused_s}
            self.trainer.emit("on_checkpoint", info)
