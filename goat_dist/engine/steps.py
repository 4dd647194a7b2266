"""One optimizer step as the engine keeps it: non-finite gradients, a dropped update, the gradient norm
and the step counters.

Why here: each of these reads or steers where DeepSpeed keeps a rank's reduced gradients and how it
decides to skip a step, which differs per ZeRO stage (``grad_partitions_flat_buffer`` at ZeRO-3,
``averaged_gradients`` at ZeRO-1/2, the parameters' own ``.grad`` without ZeRO), and its overflow path
(the one that fp16 loss scaling uses), which clears the accumulated gradients and skips the LR scheduler.
"""

from __future__ import annotations

import contextlib

import torch

COUNTERS = ("global_steps", "global_samples", "skipped_steps")  # the engine's own step counters


# ---- detection ---------------------------------------------------------------------------------------
def local_grads_nonfinite(engine) -> torch.Tensor:
    """0-d tensor on the device: 1 when this rank's share of the reduced gradients holds a NaN/Inf.

    Call after the last backward of a step, before ``engine.step()``. No host sync, no collective. (The
    non-finite values of a partitioned gradient are found by the rank holding them: the caller ORs the
    flags of every rank in its control collective.)"""
    opt = engine.optimizer
    if hasattr(opt, "grad_partitions_flat_buffer"):  # ZeRO-3: this rank's flat gradient partition
        tensors = [opt.grad_partitions_flat_buffer]
    elif hasattr(opt, "averaged_gradients"):  # ZeRO-1/2: this rank's reduced partitions
        tensors = [g for gs in opt.averaged_gradients.values() if gs for g in gs if g is not None]
    elif hasattr(opt, "fp32_groups_gradient_flat_partition"):  # BF16_Optimizer: its fp32 sums, reduced
        tensors = list(opt.fp32_groups_gradient_flat_partition)
    else:  # ZeRO-0: the all-reduced gradients live on the parameters
        tensors = [p.grad for p in engine.module.parameters() if p.grad is not None]
        tensors += [
            g for g in (getattr(p, "_hp_grad", None) for p in engine.module.parameters()) if g is not None
        ]
    device = next(engine.module.parameters()).device
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack([torch.isfinite(t).all().logical_not() for t in tensors]).any().float()


def first_nonfinite_gradient(engine) -> str | None:
    """Name of the first parameter (model order) whose full gradient holds a NaN/Inf.

    Collective over the data-parallel group under ZeRO (DeepSpeed assembles each gradient); every rank
    of a DP group holds the same gradients and so stops at the same parameter. Only for the error path.
    """
    from deepspeed.utils import safe_get_full_grad

    for name, p in engine.module.named_parameters():
        # BF16_Optimizer: the reduced fp32 sum (``.grad`` holds the last micro-batch's, not reduced)
        grad = getattr(p, "_hp_grad", None)
        grad = safe_get_full_grad(p) if grad is None else grad
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None


# ---- skipping ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def update_dropped(engine):
    """Within the block, ``engine.step()`` at the accumulation boundary drops the update: no optimizer
    step and no LR-schedule step, under every ZeRO stage.

    DeepSpeed's optimizers each have an overflow path: it clears the gradients and reports ``overflow``,
    and the engine then skips the LR scheduler. This forces that path for one step; on leaving, the
    optimizer's own methods and flags (and instance attributes such as the LR scheduler's wrapper of a
    torch optimizer's ``step``) are back."""
    opt = engine.optimizer
    patched: dict = {}
    saved_flag = None
    if hasattr(opt, "_overflow_check_and_loss_scale_update"):  # ZeRO-3

        def overflow(update_scale=True):
            opt.overflow = True
            return opt._loss_scale_update_and_overflow_cleanup() if update_scale else True

        patched["_overflow_check_and_loss_scale_update"] = overflow
    elif hasattr(opt, "check_grad_overflow") and hasattr(opt, "averaged_gradients"):  # ZeRO-1/2
        patched["check_overflow"] = lambda partition_gradients=True: setattr(opt, "overflow", True)
        saved_flag = opt.check_grad_overflow
        opt.check_grad_overflow = True
    else:  # ZeRO-0: no update at all; the engine clears the model's gradients after step()

        def no_update(*args, **kwargs):
            if hasattr(opt, "clear_hp_grads"):  # bf16 optimizer: its fp32 gradient accumulators
                opt.clear_hp_grads()
            opt.overflow = True

        patched["step"] = no_update
    had_overflow, saved_overflow = "overflow" in vars(opt), vars(opt).get("overflow")
    # instance attributes already there come back after (torch's LR scheduler wraps a torch optimizer's step)
    shadowed = {k: vars(opt)[k] for k in patched if k in vars(opt)}
    vars(opt).update(patched)  # instance attributes shadow the optimizer's methods for this step
    try:
        yield
    finally:
        for key in patched:
            vars(opt).pop(key, None)
        vars(opt).update(shadowed)
        if saved_flag is not None:
            opt.check_grad_overflow = saved_flag
        if "step" in patched:  # ZeRO-0's optimizer reports overflow only because of this block
            if had_overflow:
                opt.overflow = saved_overflow
            else:
                vars(opt).pop("overflow", None)


# ---- what a step leaves behind -----------------------------------------------------------------------
def global_grad_norm(engine) -> float:
    """The norm of the step's gradients before clipping (0.0 before the first step), the same at every
    ZeRO stage (without ZeRO ``patches.record_grad_norm`` keeps it)."""
    return float(engine.get_global_grad_norm() or 0.0)


def step_counters(engine) -> dict[str, int]:
    """The engine's own counters that a bitwise resume restores (a dropped step moves ``skipped_steps``)."""
    return {k: int(getattr(engine, k, 0) or 0) for k in COUNTERS}


def set_step_counters(engine, counters: dict[str, int]) -> None:
    for key, value in counters.items():
        setattr(engine, key, value)


# ---- batch ramp-up -----------------------------------------------------------------------------------
def set_micro_batches(engine, micro_batches: int) -> None:
    """Accumulate ``micro_batches`` micro-batches per optimizer step from now on (``train.batch_rampup``).

    Call at a step boundary. DeepSpeed's ``set_train_batch_size`` keeps its global batch in its own units
    (micro-batch x accumulation x its data-parallel world, which counts CP replicas too) and divides each
    loss by the accumulation; ZeRO-1/2/3 read the count from the engine's config at every micro-batch
    (their own copy serves CPU offload only, kept in step here). DeepSpeed finds the accumulation boundary
    from its micro-batch counter modulo the count: after a number of micro-batches the new count does not
    divide (11 steps of 1, then 2), the boundary, and with it the optimizer step, would fall mid-step; the
    counter is set back to a multiple of the new count, so each step's last micro-batch is the boundary."""
    size = engine.train_micro_batch_size_per_gpu() * micro_batches * engine.dp_world_size
    engine.set_train_batch_size(size)
    engine.micro_steps -= engine.micro_steps % micro_batches
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = micro_batches
