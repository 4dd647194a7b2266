"""What a callback sees of the trainer and may ask of it: ``TrainerAPI`` (``Callback.trainer``).

Why a small typed object instead of the trainer itself: a callback that reaches into the trainer's
internals (its engine, loop, data loader, checkpoint policy) breaks whenever they change, and it can change
them by accident. This is the whole surface; the trainer's own jobs (``checkpointing``, ``evaluation``,
``throughput``, ``memory``, ``prior``) use it too, plus what they are given when built.

Reading: ``cfg`` (the resolved config: read it, do not change it), ``layout`` (this rank's place: ``rank``,
``dp_rank``, ``tp``, ``is_main``, ``device``, ...), ``run_dir``, ``state`` (the ``RunState``: ``step``,
``consumed_samples``, ``metrics`` of the last logged step, ...), ``step``, ``metrics``, ``first_step`` (where
this process's loop began: > 0 after a resume), ``last_step_s``, ``data`` (``DataPosition``: where the
training stream is), ``deadline`` (``Deadline`` or None), ``model`` (the model, for evaluation and reading
weights; under ZeRO-3 its parameters are partitions: ``goat_dist.engine.gathered`` reads them whole),
``lr``, ``grad_norm`` (of the last step), ``state_bytes()`` (this rank's training state; collective-free).

Asking: ``request_save()``, ``request_stop(reason)`` (honoured at a step boundary on every rank alike:
they travel in the step's one collective), ``emit(event, *args)`` (an output event to every callback),
``loss(batch)`` and ``evaluating()`` (the model's loss of a loader batch, in eval mode inside the block).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...config import Config
    from ...distributed import Layout
    from ..deadline import Deadline
    from ..state import RunState


@dataclass(frozen=True)
class DataPosition:
    """Where the training data stream is, read at one moment."""

    consumed_samples: int  # sequences consumed by every step so far, all data-parallel ranks together
    consumed_tokens: int
    stream_start: int  # consumed_samples when the current stream began (train.data_resume=restart)
    micro_batches: int  # micro-batches this rank drew since its loop began
    dataset: object  # this rank's training stream: maps its micro-batches to global samples (and epochs)


class TrainerAPI:
    """The trainer as its callbacks see it (module docstring); one per trainer, given to each callback by
    ``attach``."""

    def __init__(self, trainer):
        self._trainer = trainer

    # ---- reading -----------------------------------------------------------------------------------
    @property
    def cfg(self) -> Config:
        return self._trainer.cfg

    @property
    def layout(self) -> Layout:
        return self._trainer.layout

    @property
    def run_dir(self) -> Path:
        return self._trainer.run_dir

    @property
    def state(self) -> RunState:
        return self._trainer.state

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self._trainer.state.step

    @property
    def metrics(self) -> dict:
        """The last logged step's metrics (``on_log``'s)."""
        return self._trainer.state.metrics

    @property
    def first_step(self) -> int:
        """The run state's step when this process's loop began."""
        return self._trainer.loop.first_step

    @property
    def last_step_s(self) -> float:
        """Wall time of the last optimizer step."""
        return self._trainer.loop.last_step_s

    @property
    def data(self) -> DataPosition:
        t = self._trainer
        return DataPosition(
            consumed_samples=t.state.consumed_samples,
            consumed_tokens=t.state.consumed_tokens,
            stream_start=t.state.stream_start,
            micro_batches=t.loop.micro_seen,
            dataset=getattr(t.loop.loader, "dataset", None),
        )

    @property
    def deadline(self) -> Deadline | None:
        """When the run must have saved and stopped (Slurm's job end, ``train.stop_at`` or
        ``train.time_limit_minutes``), or None."""
        return self._trainer.deadline

    @property
    def model(self) -> torch.nn.Module:
        return self._trainer.engine.module

    @property
    def lr(self) -> float:
        """The learning rate of the step about to run (read in ``pre_step``) or just run."""
        return self._trainer.engine.lr

    @property
    def grad_norm(self) -> float:
        """The last step's gradient norm before clipping (0.0 before the first step)."""
        return self._trainer.engine.grad_norm()

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state (and their total)."""
        return self._trainer.engine.state_bytes()

    # ---- asking ------------------------------------------------------------------------------------
    def request_save(self) -> None:
        """A checkpoint at the end of the current step (asked by its ``post_backward`` at the latest)."""
        self._trainer.request_save()

    def request_stop(self, reason: str) -> None:
        """Save and stop at the end of the current step; ``reason`` goes to ``last_exit.json``."""
        self._trainer.request_stop(reason)

    def emit(self, event: str, *args) -> None:
        """Send an output event (``on_log``, ``on_eval``, ...) to every callback, the run state first."""
        self._trainer.emit(event, *args)

    def loss(self, batch: dict) -> torch.Tensor:
        """The model's loss of a loader batch (``tokens``, ``position_ids``, ``labels``), moved to this
        rank's device and computed under the run's autocast. Every rank of a TP x CP group must call it."""
        t = self._trainer
        tokens, positions, labels = t.to_device(batch)
        with t.autocast():
            return t.engine(tokens, positions, labels)

    def evaluating(self):
        """A block in which the model is in eval mode and builds no graph."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._trainer.engine.evaluating())
        stack.enter_context(torch.no_grad())
        return stack
