"""The one step that turns a built model into a distributed training engine.

The model is built plain from megatron-core tensor-parallel layers for its layout (``model.layout``);
``parallelize`` applies, in this order: sequence parallelism's scatter/gather, the context-parallel split,
activation checkpointing and compilation (``model_parallel.apply``); the gradient reduction of the
parameters replicated across the TP group (``TPGradSum``, ours); and the engine
(``goat_dist.engine.build_engine``: ZeRO over the layout's data-parallel x context-parallel group,
returned as its facade ``goat_dist.engine.Engine``). What DeepSpeed does with gradients (its reduction
hooks, which the TP sum must precede) is the engine's business: ``goat_dist.engine.HeldGradHooks`` holds
them for the sum.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import collectives
from ..config import Config
from ..engine.build import HeldGradHooks, build_engine
from ..engine.zero3 import full_shape
from ..goat.prior import FP32_FORWARD
from ..optim import build_optimizer, is_prior
from . import model_parallel

if TYPE_CHECKING:
    from ..model import GPT

__all__ = [
    "TPGradSum",
    "add_tp_grad_allreduce",
    "parallelize",
    "prepare",
    "prior_params",
    "tp_partial_grad_params",
]


def parallelize(model: GPT, cfg: Config, grad_accum: int):
    """Returns the engine (``goat_dist.engine.Engine``) wrapping ``model`` (a ``model.GPT``, which it
    moves to the right device): the model set up to run in its layout (``parallel.sp``'s scatter,
    ``parallel.cp``'s split, ``train.activation_checkpointing``, ``model.compile``), the TP gradient sum
    registered, then the optimizer, then the engine (GOAT's prior computing in fp32 under bf16; the
    engine's gradient hooks on the summed parameters held for the sum).

    ``model`` may have been built already partitioned (ZeRO-3, ``engine.construct.partition_as_built``):
    its parameters are then placeholders, so the optimizer's groups read their shapes as the model
    defines them, and the engine takes the partitions as they are."""
    tp_sum = prepare(model, cfg)
    optimizer, scheduler = build_optimizer(model, cfg.train, shape_of=full_shape)
    return build_engine(
        model,
        model.layout,
        cfg,
        grad_accum,
        optimizer=optimizer,
        scheduler=scheduler,
        fp32_params=prior_params(model),
        fp32_attr=FP32_FORWARD,
        held_hooks=tp_sum.held if tp_sum is not None else None,
    )


def prepare(model: GPT, cfg: Config, compile: bool | None = None) -> TPGradSum | None:
    """The model set up to run in its layout (SP, CP, activation checkpointing, ``model.compile`` unless
    ``compile`` says otherwise) and its TP gradient sum registered: all of ``parallelize`` but the
    optimizer and the engine (the rehearsal, ``goat_dist.rehearsal``, stands in for those)."""
    model_parallel.apply(
        model,
        activation_checkpointing=cfg.train.activation_checkpointing,
        compile=model_parallel.resolve_compile(cfg.model.compile) if compile is None else compile,
    )
    return add_tp_grad_allreduce(model)


def prior_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_prior(name)]


def tp_partial_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient on one TP rank covers only that rank's share of the work:
    norms under sequence parallelism (a slice of the sequence) and GOAT's shared sink MLP (a slice of
    the heads). Their gradients must be summed over the TP group."""
    params = []
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) or ".prior.sink_mlp." in name:
            params.append(p)
    return params


class TPGradSum:
    """The TP-group sum of ``tp_partial_grad_params``' gradients: ONE flat all-reduce per backward, not
    one small collective per parameter (2 norms per layer under SP, 4 sink-MLP tensors per GOAT layer).

    A tensor hook stashes each such parameter's incoming gradient and lets zeros be accumulated in its
    place; once all of them have arrived (or, for any that get none, when the backward ends), one fp32
    all-reduce sums the stash and each sum is added to its ``.grad``. Only then run the gradient hooks
    that the engine registered on these parameters (``held``: the engine holds them there while it is
    built, ``goat_dist.engine.HeldGradHooks``): ZeRO's reductions see the summed gradients, as they did
    with a hook per parameter."""

    def __init__(self, params: list[nn.Parameter], group):
        self.params, self.group = params, group
        self.held = HeldGradHooks(params)  # the engine's hooks on these parameters, run after the sum
        self.all_reduces = 0  # collectives made so far (one per backward)
        self._reset()
        for i, p in enumerate(params):
            p.register_hook(functools.partial(self._capture, i))
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _reset(self) -> None:
        self.stash: list[torch.Tensor | None] = [None] * len(self.params)
        self.arrived, self.queued = 0, False

    def _capture(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        if not self.queued:  # a parameter without a gradient this backward must not hold the others back
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        self.stash[i] = grad
        return torch.zeros_like(grad)

    def _accumulated(self, p: nn.Parameter) -> None:
        self.arrived += 1
        if self.arrived == len(self.params):
            self.flush()

    def flush(self) -> None:
        """Sum the stashed gradients over TP, add them to ``.grad``, run the held hooks."""
        ready = [i for i, g in enumerate(self.stash) if g is not None]
        if ready:
            flat = torch.cat([self.stash[i].reshape(-1).float() for i in ready])
            collectives.all_reduce(flat, group=self.group)
            self.all_reduces += 1
            for i, part in zip(ready, flat.split([self.stash[i].numel() for i in ready])):
                grad = self.params[i].grad
                grad.add_(part.view_as(grad).to(grad.dtype))
        self._reset()
        for i in ready:
            self.held.run(i)


def add_tp_grad_allreduce(model: GPT) -> TPGradSum | None:
    """The TP sum of the partial gradients (``TPGradSum``) over the model's TP group, or None at TP=1 or
    without such parameters."""
    params = tp_partial_grad_params(model)
    if model.layout.tp == 1 or not params:
        return None
    return TPGradSum(params, model.tp_group)
