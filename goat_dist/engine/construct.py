"""Building the model already partitioned under ZeRO-3.

Without this, every rank builds its whole TP shard in fp32 and DeepSpeed partitions it only inside
``deepspeed.initialize``: the construction peak is the whole shard (120 GB per rank for a 30B model at
TP=1), whatever the data-parallel size. ``PartitionAsBuilt`` is the ``built`` hook of ``model.GPT``: the
model hands it each part (the embedding, every block, the final norm, the output layer) once the part is
built and initialised, and the hook partitions it at once with DeepSpeed's own ``zero.Init(module=...)``
(the conversion ``deepspeed.initialize`` would otherwise apply to the whole model), over the same group and
in the same dtype the engine uses. A rank then holds its partitions of the parts built so far plus one
part's whole tensors, never the whole shard.

The values are the model's own: each part is initialised whole (its TP shard, ``model.gpt.init_shards_``)
before it is partitioned, so the partitions are exactly those of the model built without ZeRO and
partitioned afterwards, and TP=k still starts from the slices of TP=1. ``deepspeed.initialize`` then finds
every parameter partitioned: it neither casts nor moves them (hence the cast to the engine's dtype and the
move to the device here, as the engine would have done) and converts nothing again.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Config
from ..distributed import Layout
from . import patches
from .build import MegatronMPU, deepspeed_config


def engine_dtype(cfg: Config) -> torch.dtype:
    """The dtype the engine keeps its ZeRO-3 parameters in (bf16 mode: bf16, GOAT's prior included)."""
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


class PartitionAsBuilt:
    """``model.GPT``'s ``built`` hook under ZeRO-3: partitions each part over the replica group (DP x CP)
    as soon as it exists. Collective over that group: every rank builds the same parts in the same order,
    with the same values, which one all-reduce of the part's fingerprints checks
    (``patches.check_replicas``) where DeepSpeed would broadcast each parameter from the group's first
    rank (``patches.checked_not_broadcast``).

    ``parts`` and ``largest_part_bytes`` record what passed through (the whole bytes of the largest part
    are the construction's peak above the partitions)."""

    def __init__(self, cfg: Config, grad_accum: int, layout: Layout):
        patches.skip_shm_build()  # DeepSpeed's first init would otherwise compile an op training never uses
        self.config = deepspeed_config(cfg, grad_accum)
        self.dtype = engine_dtype(cfg)
        self.parts = 0
        self.largest_part_bytes = 0
        self.mpu = MegatronMPU(layout)

    def __call__(self, part: nn.Module) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        whole = sum(p.numel() * p.element_size() for p in part.parameters())
        self.largest_part_bytes = max(self.largest_part_bytes, whole)
        self.parts += 1
        part.to(get_accelerator().current_device_name())  # buffers too: the engine no longer moves them
        with torch.no_grad():
            for p in part.parameters():
                if p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)  # what the engine's cast does (GOAT's prior included)
        group = self.mpu.get_data_parallel_group()  # DP x CP, as the engine's
        patches.check_replicas(list(part.named_parameters()), group)
        with patches.checked_not_broadcast():
            deepspeed.zero.Init(
                module=part, data_parallel_group=group, config_dict_or_path=self.config, mpu=self.mpu
            )


def partition_as_built(cfg: Config, grad_accum: int, layout: Layout) -> PartitionAsBuilt | None:
    """The ``built`` hook that builds the model partitioned: under ``parallel.zero_stage=3`` a
    ``PartitionAsBuilt``; None at ZeRO 0-2, whose engines keep every rank's whole shard anyway."""
    if cfg.parallel.zero_stage != 3:
        return None
    return PartitionAsBuilt(cfg, grad_accum, layout)
