"""Where DeepSpeed's behaviour is changed for this project, each with the reason and the test that
watches it (``tests/unit/engine/test_engine_contract.py``: a DeepSpeed upgrade shows which assumption broke).

* ``keep_fp32_through_cast``: bf16 mode casts every parameter; some must stay fp32 (GOAT's prior).
* ``undo_unfused_init_step``: bf16 + ZeRO-0 steps Adam once while it is built; no other stage does.
* ``record_grad_norm``: fp32 ZeRO-0 clips but drops the norm it computed.
* ``mark_tp_gradients``: bf16 + ZeRO-0 + TP counts only TP rank 0's gradient slices in its norm.
* ``skip_shm_build``: the CPU accelerator JIT-compiles an inference-only op on first init.

GOAT's prior in bf16 mode: DeepSpeed's bf16 mode casts every parameter's ``.data``
(``DeepSpeedEngine._cast_module_mixed_precision``), which bypasses ``GoatPrior._apply``, the hook that keeps
the prior fp32 under ``model.to(bfloat16)``. ZeRO-0 (FP16_UnfusedOptimizer: per-parameter fp32 clones) and
ZeRO-1/2 (one flat buffer per parameter group, its own fp32 partition, overflow check and norm per group)
accept a group of fp32 parameters next to bf16 groups, so the prior is excluded from the cast and has its
own group (``optim.param_groups``); its gradients travel in DeepSpeed's bf16 communication buckets
like all others. ZeRO-3 does not: it moves the partitions of all groups into ONE contiguous buffer
(``defragment`` in deepspeed/runtime/zero/utils.py asserts a single dtype; stage3.py
``_create_fp16_partitions_with_defragmentation``). Under ZeRO-3 + bf16 the prior's parameters are
therefore bf16 while their master copy and Adam state stay fp32, and ``zero3.install_fp32_mirror`` hands
the forward pass the fp32 master values (tests/unit/engine/test_bf16_prior.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .sizes import PRIOR_FP32_STAGES  # ZeRO stages whose bf16 mode can keep a group of fp32 parameters

__all__ = [
    "PRIOR_FP32_STAGES",
    "keep_fp32_through_cast",
    "mark_tp_gradients",
    "record_grad_norm",
    "skip_shm_build",
    "undo_unfused_init_step",
]


def skip_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPU inference (~20 s of g++) on first init.
    Training never uses it: mark the op incompatible so it is not built."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def keep_fp32_through_cast(params: list[nn.Parameter]):
    """While DeepSpeed's engine is built, its mixed-precision cast leaves ``params`` as they are.

    The cast replaces each parameter's ``.data``; the original fp32 tensors are put back right after it,
    before DeepSpeed builds its optimizer (which then sees fp32 parameters in the prior's group)."""
    if not params:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._cast_module_mixed_precision

    def cast(engine, *args, **kwargs):
        saved = [(p, p.data) for p in params]
        original(engine, *args, **kwargs)
        for p, data in saved:
            p.data = data

    DeepSpeedEngine._cast_module_mixed_precision = cast
    try:
        yield
    finally:
        DeepSpeedEngine._cast_module_mixed_precision = original


def undo_unfused_init_step(engine) -> None:
    """bf16 + ZeRO-0: undo the optimizer step DeepSpeed takes while building its FP16_UnfusedOptimizer.

    ``initialize_optimizer_states`` steps Adam once with zero gradients so that its state exists. That is
    not free: AdamW's decoupled weight decay shrinks the fp32 masters by lr * weight_decay, and Adam's
    step counter (its bias correction) runs one ahead for the whole run. No other stage does this, so
    bf16 ZeRO-0 trained differently from bf16 ZeRO-1/2 and from fp32 (~6e-3 relative loss after 10
    steps of the test model), and a universal resume between them changed the bias correction. The
    masters are copied again from the model weights, which that step did not touch, and Adam's state
    starts empty like everywhere else (torch creates it at the first real step)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if type(opt) is not FP16_UnfusedOptimizer:
        return
    with torch.no_grad():
        for weights, masters in zip(opt.fp16_groups, opt.fp32_groups):
            for p, master in zip(weights, masters):
                master.copy_(p.data)
    opt.optimizer.state.clear()


def mark_tp_gradients(model: nn.Module) -> int:
    """bf16 + ZeRO-0 + TP: let DeepSpeed's norm see which gradients are tensor-parallel slices.

    DeepSpeed's FP16_UnfusedOptimizer computes the norm with ``get_weight_norm`` on the gradient tensors
    and asks ``is_model_parallel_parameter`` of each of them; a gradient never carries megatron's
    ``tensor_model_parallel`` attribute, so every TP rank but 0 skips all of its gradients and the norm
    (and the clipping based on it) counts TP rank 0's slices only (0.90 of the TP=1 norm for the test
    model at TP=2; tests/integration/parallel/test_scale_out.py). Each new gradient of a TP-split parameter
    gets the
    attribute, so the norm sums every rank's slices and counts replicated parameters (identical on all
    TP ranks) once."""
    count = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.register_post_accumulate_grad_hook(_mark_grad)
            count += 1
    return count


def _mark_grad(p: nn.Parameter) -> None:
    if p.grad is not None:
        p.grad.tensor_model_parallel = True


def record_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed clips the gradients but drops the norm it computed; keep it, so that
    ``engine.get_global_grad_norm()`` (``steps.global_grad_norm``) means the same at every stage."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record():
        engine._global_grad_norm = float(
            clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        )

    engine.clip_fp32_gradients = clip_and_record
