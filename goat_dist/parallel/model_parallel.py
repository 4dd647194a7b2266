"""How a built GPT runs in parallel: ``apply(model, ...)`` sets up sequence parallelism's scatter and
gather, the context-parallel split of each batch, and activation checkpointing, so the model's forward
reads no process state of its own.

* Sequence parallelism (``parallel.sp``): megatron's TP layers are built for it (``GPT(cfg,
  sequence_parallel=True)``); ``apply`` adds the scatter of the embeddings into the sequence-parallel
  region before the blocks, and the gather before a tied output layer (without SP: megatron's
  copy-to-TP region, whose backward all-reduces).
* Context parallelism (``parallel.cp``): the CP group of this rank (``context.ContextParallel``), from
  megatron's ``parallel_state`` when ``apply`` runs, unless given; the forward splits each batch of whole
  rows into this rank's chunks with it.
* Activation checkpointing (``train.activation_checkpointing``): ``full`` recomputes each block in the
  backward, ``selective`` only each attention core (no L x L activations kept); in training only.
"""

from __future__ import annotations

from megatron.core import tensor_parallel
from torch.utils.checkpoint import checkpoint

from .context import ContextParallel, context_parallel

CHECKPOINTING = ("none", "full", "selective")
WORLD = "world"  # context=WORLD: this process's CP group, from parallel_state


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


def apply(model, *, activation_checkpointing: str = "none", context: ContextParallel | None | str = WORLD):
    """Set up ``model`` (a ``model.GPT``) to run in this process's parallel layout; returns it.

    Sequence parallelism follows the model's construction (its megatron layers are built for it or
    not). ``context``: a ``ContextParallel``, None for none, or ``WORLD`` (default): this process's,
    from megatron's parallel_state. May be called again (e.g. to change the checkpointing)."""
    if activation_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"train.activation_checkpointing must be one of {CHECKPOINTING}, got {activation_checkpointing!r}"
        )
    sp = model.sequence_parallel
    model.into_sequence_region = tensor_parallel.scatter_to_sequence_parallel_region if sp else identity
    model.tied_output_input = (
        tensor_parallel.gather_from_sequence_parallel_region
        if sp
        else tensor_parallel.copy_to_tensor_model_parallel_region
    )
    model.activation_checkpointing = activation_checkpointing
    model.block_call = recompute_when_training if activation_checkpointing == "full" else plain_call
    for block in model.blocks:
        block.attn.core_call = (
            recompute_when_training if activation_checkpointing == "selective" else plain_call
        )
    model.context = context_parallel() if context == WORLD else context
    return model
