"""How a built GPT runs in parallel: ``apply(model, ...)`` sets up sequence parallelism's scatter and
gather, the context-parallel split of each batch, activation checkpointing and compilation, on the groups
of the model's own layout (``model.layout``), so the model's forward reads no process state.

* Sequence parallelism (``parallel.sp``): megatron's TP layers are built for it (``GPT(cfg,
  sequence_parallel=True)``); ``apply`` adds the scatter of the embeddings into the sequence-parallel
  region before the blocks, and the gather before a tied output layer (without SP: megatron's
  copy-to-TP region, whose backward all-reduces).
* Context parallelism (``parallel.cp``): the CP group of the model's layout (``context.ContextParallel``),
  unless given; the forward splits each batch of whole rows into this rank's chunks with it.
* Activation checkpointing (``train.activation_checkpointing``): ``full`` recomputes each block in the
  backward, ``selective`` only each attention core (no L x L activations kept); in training only.
* Compilation (``model.compile``): each block's training forward through ``torch.compile``
  (``model/compile.py``), inside the checkpointing; the first pass through the blocks is timed and
  printed once (``compiled 4 transformer blocks in 12.3 s``) on the main rank.
"""

from __future__ import annotations

import functools
import time

import torch
from megatron.core import tensor_parallel
from torch.utils.checkpoint import checkpoint

from ..engine.zero3 import mark_leaf
from .context import ContextParallel

COMPILE_CHOICES = ("auto", True, False)


def resolve_compile(setting, cuda: bool | None = None) -> bool:
    """``model.compile`` -> whether to compile: ``auto`` compiles on CUDA only (on CPU the compile takes
    longer than it saves in a short run: docs/performance.md), True / False as given."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"model.compile must be one of auto, true, false; got {setting!r}")
    if setting == "auto":
        return torch.cuda.is_available() if cuda is None else cuda
    return bool(setting)


CHECKPOINTING = ("none", "full", "selective")
LAYOUT = "layout"  # context=LAYOUT: the CP group of the model's layout


def plain_call(module, fn, *args):
    """``fn(*args)``: a block or attention core run as it is."""
    return fn(*args)


def recompute_when_training(module, fn, *args):
    """``fn(*args)``, recomputed in the backward (activation checkpointing) while ``module`` trains."""
    if module.training:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def identity(x):
    return x


def apply(
    model,
    *,
    activation_checkpointing: str = "none",
    context: ContextParallel | None | str = LAYOUT,
    compile: bool = False,
):
    """Set up ``model`` (a ``model.GPT``) to run in its layout (``model.layout``); returns it.

    Sequence parallelism follows the model's construction (its megatron layers are built for it or
    not). ``context``: a ``ContextParallel``, None for none, or ``LAYOUT`` (default): the layout's CP
    group. ``compile``: each block's training forward compiled. May be called again (e.g. to change the
    checkpointing)."""
    if activation_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"train.activation_checkpointing must be one of {CHECKPOINTING}, got {activation_checkpointing!r}"
        )
    sp, layout, group = model.sequence_parallel, model.layout, model.tp_group
    if sp:
        model.into_sequence_region = functools.partial(
            tensor_parallel.scatter_to_sequence_parallel_region, group=group
        )
        model.tied_output_input = functools.partial(
            tensor_parallel.gather_from_sequence_parallel_region, group=group
        )
    else:
        model.into_sequence_region = identity
        model.tied_output_input = functools.partial(
            tensor_parallel.copy_to_tensor_model_parallel_region, group=group
        )
    model.activation_checkpointing = activation_checkpointing
    model.block_call = recompute_when_training if activation_checkpointing == "full" else plain_call
    for block in model.blocks:
        block.attn.core_call = (
            recompute_when_training if activation_checkpointing == "selective" else plain_call
        )
    if context == LAYOUT:
        context = ContextParallel(layout.cp, layout.cp_rank, layout.cp_group) if layout.cp > 1 else None
    model.context = context
    for block in model.blocks:
        block.compiled = compile
        # ZeRO-3 then gathers the block's parameters in the block's own hooks, outside the compiled
        # forward, and registers none on its submodules (no hook inside the graph)
        mark_leaf(block, compile)
    if compile and getattr(model, "compile_clock", None) is None:
        blocks = len(model.blocks)
        main = layout.is_main
        model.compile_clock = FirstPassClock(lambda s: _report_compile(blocks, s) if main else None)
    elif not compile:
        model.compile_clock = None
    return model


def _report_compile(blocks: int, seconds: float) -> None:
    print(
        f"model.compile: compiled {blocks} transformer blocks in {seconds:.1f} s "
        "(the first training forward and backward through them)",
        flush=True,
    )


class FirstPassClock:
    """Times the first training pass through the compiled blocks, forward and backward: torch.compile
    compiles the forward at its first call and the backward at the first backward, so that pass is the
    compilation (plus one step's eager-sized work). Reported once through ``report(seconds)``."""

    def __init__(self, report):
        self.report = report
        self.seconds: float | None = None  # set once reported
        self.waiting = True  # until the first training forward through the blocks has been timed
        self._started = self._backward_from = None
        self._forward = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, first_input: torch.Tensor, last_output: torch.Tensor) -> None:
        """After the blocks' forward: reports now, or once the backward has gone through them."""
        self._forward = time.perf_counter() - self._started
        self.waiting = False
        if not (torch.is_grad_enabled() and first_input.requires_grad and last_output.requires_grad):
            self._done(self._forward)
            return
        last_output.register_hook(self._backward_starts)
        first_input.register_hook(self._backward_ends)

    def _backward_starts(self, grad):
        self._backward_from = time.perf_counter()

    def _backward_ends(self, grad):
        if self.seconds is None and self._backward_from is not None:
            self._done(self._forward + time.perf_counter() - self._backward_from)

    def _done(self, seconds: float) -> None:
        self.seconds = seconds
        self.report(seconds)
