"""The callback interface: what the training loop tells its callbacks, and when.

A callback is attached to the trainer before the loop starts (``attach``: ``self.trainer``) and gets
the events below, each with the ``RunState`` first. Every rank runs the loop's events; the loggers live on
the main rank only, while the trainer's own jobs (checkpointing, evaluation, pictures, throughput, memory:
the other modules of this package) and ``train.callbacks`` plugins run on every rank, since their work
may be collective. A callback defines the events it needs (subclassing ``Callback`` gives the rest as
no-ops); callbacks run in ascending ``order``, then in the order they were given.

Loop events, every rank:

* ``pre_step(state)``: an optimizer step begins (``state.step`` steps are done).
* ``post_forward(state, micro, loss)``: a micro-batch's loss before its backward; a callback may return a
  replacement (an added loss term, a rescale), None keeps it.
* ``post_backward(state)``: the step's last backward is done, its collective is next: the last moment to
  ask for a save or a stop that this step boundary honours (``trainer.request_save()``,
  ``trainer.request_stop(reason)``; requests travel in that one collective, ``control.agree``, so every
  rank decides alike).
* ``pre_optim_step(state, control)``: the ranks agreed (``control``: loss, flags, requests); the
  optimizer step (or the dropped update, ``control.dropped``) is next.
* ``post_step(state, control)``: the step is done and counted in ``state``; logging, evaluation,
  pictures and checkpoints happen here, in that order.
* ``on_stop(state, reason)``: the loop stops early (a signal, the deadline, a request), its checkpoint
  published.
* ``on_error(state, error)``: the loop raised ``error`` (re-raised after the callbacks).

Output events (sent by the trainer and its jobs; the loggers write them):
``on_train_start(state, info)``, ``on_log(state, metrics)``, ``on_eval(state, metrics)``,
``on_memory(state, memory)`` (min, mean, max over ranks), ``on_checkpoint(state, info)``,
``on_prior(state, pictures)``, ``on_train_end(state)`` (after the loop; the end-of-run checkpoint is
saved first).
"""

from __future__ import annotations

from ..state import RunState


class Callback:
    order = 100  # the trainer's jobs: 10-40, loggers 50; plugins after them unless they say otherwise
    trainer = None

    def attach(self, trainer) -> None:
        self.trainer = trainer

    # loop events
    def pre_step(self, state: RunState) -> None: ...
    def post_forward(self, state: RunState, micro: int, loss): ...
    def post_backward(self, state: RunState) -> None: ...
    def pre_optim_step(self, state: RunState, control) -> None: ...
    def post_step(self, state: RunState, control) -> None: ...
    def on_stop(self, state: RunState, reason: str) -> None: ...
    def on_error(self, state: RunState, error: BaseException) -> None: ...

    # output events
    def on_train_start(self, state: RunState, info: dict) -> None: ...
    def on_log(self, state: RunState, metrics: dict) -> None: ...
    def on_eval(self, state: RunState, metrics: dict) -> None: ...
    def on_memory(self, state: RunState, memory: dict) -> None: ...
    def on_checkpoint(self, state: RunState, info: dict) -> None: ...
    def on_prior(self, state: RunState, pictures: dict) -> None: ...
    def on_train_end(self, state: RunState) -> None: ...
