"""GOAT's prior computes from its fp32 values under ZeRO-3 + bf16, as it does under ZeRO 0-2.

ZeRO-3 keeps every parameter partition in one buffer of one dtype (``defragment`` in DeepSpeed's
``zero/utils.py``), so the prior's parameters are bf16 there while their master copy and Adam state stay
fp32 in the optimizer's partitions. bf16 keeps 8 bits of mantissa: a recency slope or a small lambda
rounded to it is off by up to 0.4 %, and an update smaller than that spacing would never show in the
forward pass. Before each forward this module gathers the prior's fp32 master partitions over the
partition group (one all-gather of a few thousand numbers, on the device) and attaches each parameter's
full fp32 value as ``p.fp32_forward``; ``attention.prior.forward_value`` then computes from that value
exactly while the gradient flows to the bf16 parameter, which DeepSpeed reduces and applies to the
master as usual.
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

    def sync(self) -> None:
        """Collective over the partition group (DP x CP): every rank calls it, at every forward."""
        parts = [
            self.opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0] for p in self.params
        ]
        local = torch.cat([t.reshape(-1) for t in parts])
        world = dist.get_world_size(group=self.group)
        gathered = [local]
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local, group=self.group)
        offset = 0
        for p, part in zip(self.params, parts):
            n = part.numel()
            full = torch.cat([g[offset : offset + n] for g in gathered])[: p.ds_numel]
            setattr(p, FP32_FORWARD, full.view(p.ds_shape))
            offset += n


def install(engine, params: list[torch.nn.Parameter]) -> Zero3PriorMirror:
    """Sync now and before every forward of ``engine.module``; ``engine.module.sync_prior_masters`` lets
    code that reads the prior outside a forward (the prior pictures) sync first."""
    mirror = Zero3PriorMirror(engine, params)
    mirror.sync()
    engine.module.register_forward_pre_hook(lambda module, args: mirror.sync())
    engine.module.sync_prior_masters = mirror.sync
    return mirror
