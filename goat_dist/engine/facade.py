"""The engine as the rest of goat_dist sees it: ``Engine``, the few operations training, checkpoints,
evaluation and memory accounting need, in the spirit of OLMo-core's ``TrainModule``.

Why a facade: DeepSpeed's engine object exposes hundreds of attributes, and each one read elsewhere is an
assumption a DeepSpeed upgrade can break far from this package. Outside ``goat_dist/engine/`` only this
object travels (``build.build_engine`` returns it); the DeepSpeed engine it wraps (``Engine.deepspeed``) is
for this package and for the tests that check DeepSpeed's contract
(``tests/unit/engine/test_engine_contract.py``).
No module outside ``engine/`` imports ``deepspeed`` or holds its engine
(``tests/unit/repo/test_import_floors.py``,
``tests/unit/repo/test_package_promises.py``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import masters as _masters
from . import steps as _steps
from .memory import training_state_bytes


class Engine:
    """One model under training: forward and backward of micro-batches, the optimizer step (or a dropped
    one), what a step leaves (gradient norm, learning rate), the state a checkpoint saves and loads, the
    bytes of training state, and the module itself for evaluation and reading weights.

    Gradient accumulation: ``backward(loss, last=False)`` for every micro-batch but the step's last, whose
    ``backward(loss)`` is followed by one ``step()`` (the update) or ``step(drop=True)`` (none). Between
    the last backward and ``step`` the step's gradients are reduced: ``grads_nonfinite``,
    ``first_nonfinite_gradient`` read them."""

    def __init__(self, deepspeed_engine):
        self.deepspeed = deepspeed_engine  # engine/ and DeepSpeed's contract tests only

    # ---- the model -------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The model (its parameters ZeRO-3 partitions under ZeRO-3: ``zero3.gathered`` reads them whole)."""
        return self.deepspeed.module

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """The forward pass (a micro-batch's loss), through the engine's hooks (ZeRO-3 gathers, the fp32
        prior mirror)."""
        return self.deepspeed(*args, **kwargs)

    @contextlib.contextmanager
    def evaluating(self):
        """The model in eval mode for the block (dropout off), back in training mode after."""
        self.deepspeed.eval()
        try:
            yield self
        finally:
            self.deepspeed.train()

    # ---- a step ----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Backward of one micro-batch's loss. ``last=False`` (every micro-batch of a step but its last):
        the gradients accumulate and the micro-batch is counted (DeepSpeed's ``step()`` off the
        accumulation boundary does only that); the step's last backward reduces them."""
        self.deepspeed.backward(loss)
        if not last:
            self.deepspeed.step()

    def step(self, drop: bool = False) -> None:
        """The optimizer and LR-schedule step at the accumulation boundary; ``drop``: neither, and the
        gradients are cleared (a non-finite or unreadable step; ``steps.update_dropped``)."""
        if drop:
            with _steps.update_dropped(self.deepspeed):
                self.deepspeed.step()
        else:
            self.deepspeed.step()

    def grads_nonfinite(self) -> torch.Tensor:
        """0-d device tensor, 1 when this rank's share of the reduced gradients holds a NaN/Inf (after the
        step's last backward; no host sync, no collective)."""
        return _steps.local_grads_nonfinite(self.deepspeed)

    def first_nonfinite_gradient(self) -> str | None:
        """The first parameter (model order) with a NaN/Inf gradient; collective over DP (error path)."""
        return _steps.first_nonfinite_gradient(self.deepspeed)

    def grad_norm(self) -> float:
        """The last step's gradient norm before clipping (0.0 before the first step)."""
        return _steps.global_grad_norm(self.deepspeed)

    @property
    def lr(self) -> float:
        """The learning rate the next step uses (the first group's; every group follows one schedule)."""
        return self.deepspeed.get_lr()[0]

    def set_micro_batches(self, micro_batches: int) -> None:
        """Accumulate ``micro_batches`` micro-batches per step from the next step on (batch ramp-up)."""
        _steps.set_micro_batches(self.deepspeed, micro_batches)

    def param_group_names(self) -> list:
        """The optimizer's group names, in order (a checkpoint's layout records them)."""
        return [g.get("name") for g in self.deepspeed.optimizer.param_groups]

    # ---- checkpoints -----------------------------------------------------------------------------------
    def masters(self, error: type[Exception] = RuntimeError) -> _masters.MasterLayout:
        """Where this rank's fp32 masters and Adam moments live (``masters``); ``error``: the exception an
        unknown optimizer layout raises."""
        return _masters.layout_of(self.deepspeed, error)

    @property
    def scheduler(self):
        """The LR schedule (the torch scheduler the engine was built with), or None."""
        return self.deepspeed.lr_scheduler

    def step_counters(self) -> dict[str, int]:
        """The engine's own step counters, which a bitwise resume restores."""
        return _steps.step_counters(self.deepspeed)

    def set_step_counters(self, counters: dict[str, int]) -> None:
        _steps.set_step_counters(self.deepspeed, counters)

    # ---- memory ----------------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state (``memory``), and the total."""
        return training_state_bytes(self.deepspeed.module, self.deepspeed.optimizer)

    def __repr__(self) -> str:
        return f"Engine({type(self.deepspeed.optimizer).__name__})"
