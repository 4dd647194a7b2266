"""GOAT's prior computes from its fp32 values under ZeRO-3 + bf16, as it does under ZeRO 0-2.

ZeRO-3 keeps every parameter partition in one buffer of one dtype (``defragment`` in DeepSpeed's
``zero/utils.py``), so the prior's parameters are bf16 there while their master copy and Adam state stay
fp32 in the optimizer's partitions. bf16 keeps 8 bits of mantissa: a recency slope or a small lambda
rounded to it is off by up to 0.4 %, and an update smaller than that spacing would never show in the
forward pass. Before each forward whose masters changed, this module gathers the prior's fp32 master
partitions over the partition group (one all-gather of a few thousand numbers, on the device) and
attaches each parameter's full fp32 value as ``p.fp32_forward``; ``attention.prior.forward_value`` then
computes from that value exactly while the gradient flows to the bf16 parameter, which DeepSpeed reduces
and applies to the master as usual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.prior import FP32_FORWARD


class Zero3PriorMirror:
    """Keeps ``p.fp32_forward`` of the given ZeRO-3 parameters equal to their fp32 master values."""

    def __init__(self, engine, params: list[torch.nn.Parameter]):
        self.opt = engine.optimizer
        self.params = params
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
        forward after ``install`` (a checkpoint loaded in between writes the masters without a step).
        One flat all-gather: rank r's partitions of all the parameters are row r of the result, and each
        parameter's full value is its columns, read row by row."""
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
            setattr(p, FP32_FORWARD, column.reshape(-1)[: p.ds_numel].view(p.ds_shape))
        self.changed = False


def install(engine, params: list[torch.nn.Parameter]) -> Zero3PriorMirror:
    """Sync now and before every forward of ``engine.module``; ``engine.module.sync_prior_masters`` lets
    code that reads the prior outside a forward (the prior pictures) sync first."""
    mirror = Zero3PriorMirror(engine, params)
    mirror.sync()
    mirror.changed = True  # a checkpoint may be loaded before the first forward
    engine.module.register_forward_pre_hook(lambda module, args: mirror.sync())
    engine.module.sync_prior_masters = mirror.sync
    return mirror
