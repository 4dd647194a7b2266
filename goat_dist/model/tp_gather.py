"""Reassemble tensor-parallel shards into the full tensors a TP=1 model would hold."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def full_tensor(param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather ``local`` (default: ``param`` itself, e.g. pass ``param.grad``) across the TP group.

    Follows megatron's attributes: ``partition_dim`` and ``partition_stride`` (a strided split, as for
    SwiGLU's fused gate/up matrix, puts chunk ``s`` of every rank before chunk ``s + 1``). Replicated
    tensors come back unchanged. Every TP rank must call this (it is a collective when TP > 1).
    """
    local = param if local is None else local
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local.detach().clone()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(
        parts, local.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    if stride == 1:
        return torch.cat(parts, dim=dim)
    chunks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(tp)], dim=dim)
