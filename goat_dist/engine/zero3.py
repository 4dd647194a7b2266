"""ZeRO-3 parameters: their local partition, their whole shape, gathering them, and fp32 forward values.

DeepSpeed splits each flattened parameter into equal partitions, one per rank of the parameter's
partition group (``p.ds_tensor``; ``p.ds_numel`` real elements, ``p.ds_shape`` the shape before
partitioning), and pads the last ones with *uninitialised* memory (``torch.empty``). Anything that reads a
partition (the weight norm, the non-finite check, the checkpoint masters) must stop at the real elements:
the padding can hold NaN/Inf bits from whatever was there before.

The fp32 forward mirror: ZeRO-3 keeps every parameter partition in one buffer of one dtype (``defragment``
in DeepSpeed's ``zero/utils.py``), so parameters that must compute in fp32 under bf16 (GOAT's prior) are
bf16 there while their master copy and Adam state stay fp32 in the optimizer's partitions. bf16 keeps 8
bits of mantissa: a recency slope or a small lambda rounded to it is off by up to 0.4 %, and an update
smaller than that spacing would never show in the forward pass. Before each forward whose masters changed,
the mirror gathers those parameters' fp32 master partitions over the partition group (one all-gather of a
few thousand numbers, on the device) and attaches each parameter's full fp32 value as an attribute the
model reads (``goat.prior.forward_value``); the gradient still flows to the bf16 parameter, which
DeepSpeed reduces and applies to the master as usual.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def is_partitioned(p) -> bool:
    """True for a ZeRO-3 parameter (its data is a placeholder; ``partition_values`` holds this rank's)."""
    return hasattr(p, "ds_tensor")


def is_engine_param(p) -> bool:
    """True for a parameter ZeRO-3 has taken over (gathered by ``gathered``)."""
    return hasattr(p, "ds_id")


def full_shape(p) -> list[int]:
    """The shape of ``p`` as the model defines it (under ZeRO-3: before partitioning)."""
    return list(getattr(p, "ds_shape", None) or p.shape)


def partition_tensor(p) -> torch.Tensor | None:
    """``p``'s local ZeRO-3 partition, padding included (None outside ZeRO-3)."""
    return getattr(p, "ds_tensor", None)


def partition_rank(p) -> int:
    """This rank's index in ``p``'s ZeRO-3 partition group (0 outside a distributed world)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=getattr(p, "ds_process_group", None))


def partition_span(p, rank: int | None = None) -> tuple[int, int]:
    """(first flat element, number of real elements) of ``p``'s partition on ``rank``."""
    size = p.ds_tensor.numel()
    start = size * (partition_rank(p) if rank is None else rank)
    return start, max(0, min(size, p.ds_numel - start))


def partition_values(p, rank: int | None = None) -> torch.Tensor:
    """The real (unpadded) elements of ``p``'s local ZeRO-3 partition, as a flat view."""
    return p.ds_tensor.reshape(-1)[: partition_span(p, rank)[1]]


def local_values(p) -> torch.Tensor:
    """What this rank holds of ``p``: its real ZeRO-3 partition elements, or ``p`` itself."""
    return partition_values(p) if is_partitioned(p) else p


def mark_leaf(module: torch.nn.Module, leaf: bool = True) -> None:
    """Mark ``module`` a ZeRO-3 leaf (DeepSpeed's ``_z3_leaf``, read by ``z3_leaf_module``) or not: ZeRO-3
    then gathers all of its parameters in its own hooks and registers none on its submodules, so a compiled
    block's forward runs no hook inside its graph (``model/compile.py``). A plain attribute: no effect
    without ZeRO-3, and none on a model that is never given to the engine."""
    module._z3_leaf = leaf  # type: ignore[assignment]  # a plain flag, not a submodule or a tensor


def gathered(module: torch.nn.Module):
    """A context in which ``module``'s ZeRO-3 parameters are whole on every rank (read only; a no-op
    without ZeRO-3). Collective over the partition group."""
    params = [p for p in module.parameters() if is_engine_param(p)]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class Zero3Fp32Mirror:
    """Keeps ``getattr(p, attr)`` of the given ZeRO-3 parameters equal to their fp32 master values."""

    def __init__(self, engine, params: list[torch.nn.Parameter], attr: str):
        self.opt = engine.optimizer
        self.params, self.attr = params, attr
        groups = {id(self.opt._get_param_partition_group(p)) for p in params}
        if len(groups) != 1:
            raise RuntimeError(f"GOAT's prior parameters span {len(groups)} ZeRO-3 partition groups, not one")
        self.group = self.opt._get_param_partition_group(params[0])
        self.gathers = 0  # all-gathers made so far: one per change of the masters
        self.changed = True  # the masters may differ from the gathered values
        step = self.opt.step

        def step_and_mark(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self.changed = True

        self.opt.step = step_and_mark

    def sync(self) -> None:
        """Collective over the partition group (DP x CP): every rank calls it, before every forward.

        It gathers only when the masters may have changed: after an optimizer step, and at the first
        forward after ``install_fp32_mirror`` (a checkpoint loaded in between writes the masters without a
        step). One flat all-gather: rank r's partitions of all the parameters are row r of the result, and
        each parameter's full value is its columns, read row by row."""
        if not self.changed:
            return
        parts = [
            self.opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0] for p in self.params
        ]
        local = torch.cat([t.detach().reshape(-1) for t in parts])  # the masters are optimizer leaves
        world = dist.get_world_size(group=self.group)
        rows = local
        if world > 1:
            rows = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(rows, local, group=self.group)
        rows = rows.view(world, local.numel())
        self.gathers += 1
        for p, column in zip(self.params, rows.split([t.numel() for t in parts], dim=1)):
            setattr(p, self.attr, column.reshape(-1)[: p.ds_numel].view(p.ds_shape))
        self.changed = False


def install_fp32_mirror(engine, params: list[torch.nn.Parameter], attr: str) -> Zero3Fp32Mirror:
    """Sync now and before every forward of ``engine.module``; ``engine.module.sync_prior_masters`` lets
    code that reads these parameters outside a forward (the prior pictures) sync first."""
    mirror = Zero3Fp32Mirror(engine, params, attr)
    mirror.sync()
    mirror.changed = True  # a checkpoint may be loaded before the first forward
    engine.module.register_forward_pre_hook(lambda module, args: mirror.sync())
    engine.module.sync_prior_masters = mirror.sync
    return mirror
