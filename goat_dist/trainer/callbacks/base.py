"""The callback interface: what the training loop tells its callbacks, and when.

A callback is attached to the trainer before the loop starts (``attach``: ``self.trainer`` is the
trainer's ``TrainerAPI``, ``api.py``: the run's config, layout, state, data position, deadline, model, and
``request_save`` / ``request_stop`` / ``emit``; never the trainer's internals) and gets the events below,
each with the ``RunState`` first. Every rank runs the loop's events; the loggers live on the main rank only,
while the trainer's own jobs (checkpointing, evaluation, pictures, throughput, memory: the other modules of
this package) and ``train.callbacks`` plugins run on every rank, since their work may be collective. A
callback defines the events it needs (subclassing ``Callback`` gives the rest as no-ops); callbacks run in
ascending ``order``, then in the order they were given.

Loop events, every rank:

* ``pre_step(state)``: an optimizer step begins (``state.step`` steps are done).
* ``post_forward(state, micro, loss)``: a micro-batch's loss before its backward; a callback may return a
  replacement (an added loss term, a rescale), None keeps it.
* ``post_backward(state)``: the step's last backward is done, its collective is next: the last moment to
  ask for a save or a stop that this step boundary honours (``self.trainer.request_save()``,
  ``self.trainer.request_stop(reason)``; requests travel in that one collective, ``control.agree``, so
  every rank decides alike).
* ``pre_optim_step(state, control)``: the ranks agreed (``control``: loss, flags, requests); the
  optimizer step (or the dropped update, ``control.dropped``) is next.
* ``post_step(state, control)``: the step is done and counted in ``state``; logging, evaluation,
  pictures and checkpoints happen here, in that order.
* ``on_stop(state, reason)``: the loop stops early (a signal, the deadline, a request), its checkpoint
  published.
* ``on_error(state, error)``: the loop raised ``error`` (re-raised after the callbacks).

A save's progress, every rank (sent by the checkpoint manager: the one event bus):
``on_checkpoint_file_written(state, step_dir, name)`` for each file an asynchronous save's background
writer finished (on the writer's thread), ``on_checkpoint_shards_written(state, step_dir, step)`` once
every rank's files are on disk and hashed, before the manifest and ``latest``, and
``on_checkpoint_published(state, step_dir, step)`` once ``latest`` names it.

Output events (sent by the trainer and its jobs; the loggers write them):
``on_train_start(state, info)``, ``on_log(state, metrics)``, ``on_eval(state, metrics)``,
``on_memory(state, memory)`` (min, mean, max over ranks), ``on_checkpoint(state, info)``,
``on_prior(state, pictures)``, ``on_train_end(state)`` (after the loop; the end-of-run checkpoint is
saved first).

State across a resume: a callback whose ``state_dict()`` returns a dict (JSON: numbers, strings, lists,
dicts) has it saved in every checkpoint's ``trainer_state.json`` (rank 0's, under ``callbacks``, keyed by
``state_key``: the class name unless the callback sets one, numbered when a class appears twice), and
gets it back through ``load_state_dict(state)`` when the run resumes from that checkpoint, on every rank,
before its first event. A checkpoint without it (written before, or by a run without the callback)
leaves the callback fresh. ``None`` (the default) saves nothing.
"""

from __future__ import annotations

from ..state import RunState
from .api import TrainerAPI


class Callback:
    order = 100  # the trainer's jobs: 10-40, loggers 50; plugins after them unless they say otherwise
    # set by ``attach`` before any event; None until then (a callback used outside a trainer)
    trainer: TrainerAPI = None  # type: ignore[assignment]
    state_key: str | None = None  # names this callback's saved state; default: its class name

    def attach(self, trainer: TrainerAPI) -> None:
        self.trainer = trainer

    # state across a resume
    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None: ...

    # loop events
    def pre_step(self, state: RunState) -> None: ...
    def post_forward(self, state: RunState, micro: int, loss): ...
    def post_backward(self, state: RunState) -> None: ...
    def pre_optim_step(self, state: RunState, control) -> None: ...
    def post_step(self, state: RunState, control) -> None: ...
    def on_stop(self, state: RunState, reason: str) -> None: ...
    def on_error(self, state: RunState, error: BaseException) -> None: ...

    # a save's progress
    def on_checkpoint_file_written(self, state: RunState, step_dir, name: str) -> None: ...
    def on_checkpoint_shards_written(self, state: RunState, step_dir, step: int) -> None: ...
    def on_checkpoint_published(self, state: RunState, step_dir, step: int) -> None: ...

    # output events
    def on_train_start(self, state: RunState, info: dict) -> None: ...
    def on_log(self, state: RunState, metrics: dict) -> None: ...
    def on_eval(self, state: RunState, metrics: dict) -> None: ...
    def on_memory(self, state: RunState, memory: dict) -> None: ...
    def on_checkpoint(self, state: RunState, info: dict) -> None: ...
    def on_prior(self, state: RunState, pictures: dict) -> None: ...
    def on_train_end(self, state: RunState) -> None: ...
