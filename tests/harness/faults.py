"""Faults injected by test-side callbacks, so the recovery paths run for real: a NaN loss or gradient,
NaN weights, a SIGKILL between writing a checkpoint's shards and publishing it, in the middle of an
asynchronous save's background write, or at the end of a step.

In-process: ``trainer.add_callback(NaNGradient(2))``. In a ``goat-dist train`` subprocess (torchrun,
launch/local.sh, Slurm): the config key ``train.callbacks`` names them, e.g.
``train.callbacks=[harness.faults:KillAfter:10]`` (``fault_override``), with ``tests/`` on the child's
``PYTHONPATH`` (``fault_env``). Every entry is a step, a range ``a-b``, and for the loss faults the
micro-batch and data-parallel rank that fail (default 0 and 0); the arguments arrive as strings."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from goat_dist.checkpoint.names import tag_for
from goat_dist.trainer.callbacks import Callback

ROOT = Path(__file__).resolve().parents[2]


def fault_env(**extra) -> dict:
    """Environment for a child that loads these callbacks: this checkout and tests/ on its PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **extra}


def fault_override(*entries: str) -> str:
    """``train.callbacks=[harness.faults:<entry>,...]`` for a command line (``"KillAfter:10"``)."""
    return "train.callbacks=[" + ",".join(f"harness.faults:{e}" for e in entries) + "]"


def _steps(text) -> range:
    first, _, last = str(text).partition("-")
    return range(int(first), int(last or first) + 1)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _LossFault(Callback):
    """A fault in the loss of micro-batch ``micro`` on data-parallel rank ``dp_rank`` in ``steps``."""

    def __init__(self, steps, micro=0, dp_rank=0):
        self.steps, self.micro, self.dp_rank = _steps(steps), int(micro), int(dp_rank)

    def post_forward(self, state, micro, loss):
        due = state.step + 1 in self.steps and micro == self.micro
        if due and self.trainer.layout.dp_rank == self.dp_rank:
            return self.poison(loss)
        return None


class NaNLoss(_LossFault):
    """A NaN in the loss (and so in every gradient) of the chosen micro-batch."""

    def poison(self, loss):
        return loss * float("nan")


class NaNGradient(_LossFault):
    """A finite loss whose gradient is NaN: value 0 added, gradient 0 * inf on the first parameter."""

    def poison(self, loss):
        weight = next(self.trainer.model.parameters())
        return loss + (weight.sum() * 0).sqrt()


class NaNWeights(Callback):
    """A NaN written into the first parameter after the update of step ``step``, before anything at that
    step boundary (log, evaluation, checkpoint) sees the weights."""

    order = 0

    def __init__(self, step):
        self.steps = _steps(step)

    def post_step(self, state, control):
        if state.step in self.steps:
            with torch.no_grad():
                next(self.trainer.model.parameters()).view(-1)[0] = float("nan")


class KillAfter(Callback):
    """Every rank SIGKILLs itself once step ``step`` and its checkpoint are done: a ``kill -9`` that lands
    at a known step, however fast the machine trains."""

    order = 1000  # after every other callback's work at that step boundary

    def __init__(self, step):
        self.steps = _steps(step)

    def post_step(self, state, control):
        if state.step in self.steps:
            _kill()


class _CheckpointFault(Callback):
    """A fault at a point of a save's progress (the callbacks' ``on_checkpoint_*`` events)."""

    def __init__(self, step):
        self.tags = {tag_for(s) for s in _steps(step)}


class KillBeforePublish(_CheckpointFault):
    """SIGKILL once every rank wrote the shards of step ``step``, before the checkpoint is published."""

    def on_checkpoint_shards_written(self, state, step_dir, step):
        if Path(step_dir).name in self.tags:
            _kill()


class KillMidAsyncWrite(_CheckpointFault):
    """SIGKILL after the first file of step ``step``'s background write (``checkpoint.async``)."""

    def on_checkpoint_file_written(self, state, step_dir, name):
        if Path(step_dir).name in self.tags:
            _kill()
