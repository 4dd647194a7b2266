"""ZeRO-3 partitions: which elements of a parameter's ``ds_tensor`` are real and which are padding.

DeepSpeed splits each flattened parameter into equal partitions, one per rank of the parameter's
partition group, and pads the last ones with *uninitialised* memory (``torch.empty``). Anything that
reads a partition (the weight norm, the non-finite check, the checkpoint masters) must stop at the
real elements: the padding can hold NaN/Inf bits from whatever was there before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
