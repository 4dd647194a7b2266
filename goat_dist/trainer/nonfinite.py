"""Non-finite losses and gradients: detection, a dropped update, and an error that says where.

``train.on_nonfinite=raise`` stops at the first step whose loss or gradients hold a NaN/Inf, naming the
step, the data (source, shard and global sample) of the offending micro-batch and the first parameter
with a non-finite gradient. ``skip`` drops that step's update: no optimizer step and no LR-schedule
step, under every ZeRO stage, by sending the step through DeepSpeed's own overflow path (the one that
fp16 loss scaling uses), which also clears the accumulated gradients.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from ..parallel.zero3 import partition_values


class NonFiniteError(RuntimeError):
    """A loss, gradient or weight is NaN/Inf; the message names the step, the data and the parameter."""


# ---- detection ---------------------------------------------------------------------------------------
def local_grads_nonfinite(engine) -> torch.Tensor:
    """0-d tensor on the device: 1 when this rank's share of the reduced gradients holds a NaN/Inf.

    Call after the last backward of a step, before ``engine.step()``. No host sync, no collective."""
    opt = engine.optimizer
    if hasattr(opt, "grad_partitions_flat_buffer"):  # ZeRO-3: this rank's flat gradient partition
        tensors = [opt.grad_partitions_flat_buffer]
    elif hasattr(opt, "averaged_gradients"):  # ZeRO-1/2: this rank's reduced partitions
        tensors = [g for gs in opt.averaged_gradients.values() if gs for g in gs if g is not None]
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
        grad = safe_get_full_grad(p)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """Name of the first parameter whose local values (a ZeRO-3 partition included) are NaN/Inf.

    A ZeRO-3 partition is read up to its real elements: its padding is uninitialised memory."""
    for name, p in model.named_parameters():
        local = partition_values(p) if hasattr(p, "ds_tensor") else p
        if not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


# ---- skipping ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def update_dropped(engine):
    """Within the block, ``engine.step()`` at the accumulation boundary drops the update.

    DeepSpeed's optimizers each have an overflow path: it clears the gradients and reports ``overflow``,
    and the engine then skips the LR scheduler. This forces that path for one step."""
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
    vars(opt).update(patched)  # instance attributes shadow the optimizer's methods for this step
    try:
        yield
    finally:
        for key in patched:
            vars(opt).pop(key, None)
        if saved_flag is not None:
            opt.check_grad_overflow = saved_flag
        if "step" in patched:  # ZeRO-0's optimizer reports overflow only because of this block
            if had_overflow:
                opt.overflow = saved_overflow
            else:
                vars(opt).pop("overflow", None)


# ---- where the data came from ------------------------------------------------------------------------
def describe_sample(dataset, n: int) -> str:
    """Source, epoch, shard(s) and window of global sample ``n`` of a ``PackedBatches`` stream."""
    from ..data.schedule import Mixture

    s, j = Mixture([src.weight for src in dataset.sources], dataset.seed).locate(n)
    source, schedule = dataset.sources[s], dataset.schedules[s]
    epoch, _, window = schedule.locate(j)
    order = schedule.shard_order(epoch)
    ends = np.cumsum([source.n_tokens[i] for i in order])
    first, last = window * schedule.seq_len, window * schedule.seq_len + schedule.seq_len
    a = int(np.searchsorted(ends, first, side="right"))
    b = int(np.searchsorted(ends, last, side="right"))
    shards = [source.shards[order[i]].rsplit("/", 1)[-1] for i in range(a, min(b, len(order) - 1) + 1)]
    return (
        f"global sample {n} (source {source.path}, shard {', '.join(shards)}, epoch {epoch}, window {window})"
    )


def raise_nonfinite(engine, step: int, control, samples: list[int], dataset, reason: str = "") -> None:
    """Collective on the error path: agree on the offending data and parameter, then raise on every rank.

    ``samples``: the global samples of this rank's first micro-batch with a non-finite loss (or [])."""
    first = torch.tensor([samples[0] if samples else -1], dtype=torch.long)
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, first)
    offending = [(rank, int(t)) for rank, t in enumerate(gathered) if int(t) >= 0]
    param = first_nonfinite_gradient(engine)
    what = "loss" if control.nonfinite_loss else "gradient"
    parts = [f"step {step}: non-finite {what}" + (f" ({reason})" if reason else "")]
    if offending:
        rank, n = offending[0]
        try:
            where = describe_sample(dataset, n)
        except (AttributeError, IndexError, ValueError):  # a generated source has no shards to name
            where = f"global sample {n} ({type(dataset).__name__})"
        parts.append(f"the micro-batch on rank {rank} starting at {where}")
    parts.append(f"first parameter with a non-finite gradient: {param}" if param else "all gradients finite")
    if not reason:
        parts.append("set train.on_nonfinite=skip to drop such updates instead")
    raise NonFiniteError("; ".join(parts))
