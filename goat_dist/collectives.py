"""Every collective of the product outside ``goat_dist/engine/``: each call puts its tensor where the group's
backend can reduce it.

On CUDA every group is NCCL only, the world's and megatron's TP, DP and CP groups among them
(``distributed.backend_for``: no gloo mesh). NCCL reduces only device tensors: a host tensor on such a
group raises "No backend type associated with device type cpu". The functions here ask the group which
device types it serves (``served_device_types``); a tensor on a device the group does not serve is copied
to the accelerator for the collective and the result copied back into the caller's tensor, so callers keep
host values where they want host values (the few host-side collectives on the world group: checkpoint
decisions, start records, log-step gathers). A tensor already on a served device is passed through
untouched (activations and gradients: no copy, no sync).

``tests/unit/core/test_collectives_home.py`` walks the package's source and fails on a direct
``torch.distributed`` collective anywhere else (``goat_dist/engine/`` excepted: DeepSpeed's own tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "COLLECTIVES",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "placement",
    "reduce_scatter_tensor",
    "served_device_types",
]

# torch.distributed's collectives (the names the source test looks for outside this module)
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
    }
)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def served_device_types(group=None) -> set[str]:
    """The device types ``group``'s backends accept (``{"cpu"}`` for gloo, ``{"cuda"}`` for NCCL, both
    for the world group of a CUDA run)."""
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)
    if types:
        return {d.type if isinstance(d, torch.device) else str(d) for d in types}
    # older torch: the backend's name tells
    backend = str(dist.get_backend(pg))
    return {"cuda"} if backend == "nccl" else {"cpu", "cuda"} if ":" in backend else {"cpu"}


def accelerator() -> torch.device:
    """The device an accelerator-only group (NCCL) reduces on: this process's current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


def placement(tensor: torch.Tensor, group=None) -> torch.device:
    """Where ``tensor`` must be for a collective on ``group``: where it is when the group serves that
    device type, else the accelerator."""
    if tensor.device.type in served_device_types(group):
        return tensor.device
    return accelerator()


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=False)


def _placed(tensor: torch.Tensor, group) -> torch.Tensor:
    device = placement(tensor, group)
    return tensor if device == tensor.device else _move(tensor, device)


def _through(call, out: torch.Tensor, *inputs: torch.Tensor, group=None, **kwargs) -> torch.Tensor:
    """``call(out, *inputs, group=group, **kwargs)`` with every tensor where ``group`` can take it, and the
    result written back into the caller's ``out``."""
    moved = _placed(out, group)
    call(moved, *(_placed(x, group) for x in inputs), group=group, **kwargs)
    if moved is not out:
        out.copy_(moved)
    return out


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: sum, max or min) and return it."""
    return _through(dist.all_reduce, tensor, group=group, op=_OPS[op])


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (equal shapes), in group rank order, on ``tensor``'s device."""
    moved = _placed(tensor.contiguous(), group)
    parts = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, moved, group=group)
    return parts if moved.device == tensor.device else [p.to(tensor.device) for p in parts]


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` from global rank ``src``, in place on every rank."""
    return _through(dist.broadcast, tensor, group=group, src=src)


def all_gather_into_tensor(out: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 into ``out`` (device tensors: activations)."""
    return _through(dist.all_gather_into_tensor, out, tensor, group=group)


def reduce_scatter_tensor(out: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's dim-0 slice in ``out``."""
    return _through(dist.reduce_scatter_tensor, out, tensor, group=group)


def all_to_all_single(
    out: torch.Tensor, tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group=None
) -> torch.Tensor:
    """Send ``tensor``'s consecutive parts of ``in_sizes`` elements to the group's ranks in order, and
    receive theirs into ``out`` (parts of ``out_sizes``): a checkpoint's exchange of a ZeRO-stage change."""
    return _through(
        dist.all_to_all_single,
        out,
        tensor,
        group=group,
        output_split_sizes=out_sizes,
        input_split_sizes=in_sizes,
    )


def barrier(group=None) -> None:
    dist.barrier(group=group)


# Object collectives pickle into byte tensors that torch places itself (on the current CUDA device for an
# NCCL group, such as the world's on a CUDA run).


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_list(objects: list, src: int = 0, group=None) -> list:
    dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def gather_object(obj, dst: int = 0, group=None) -> list | None:
    """Every rank's ``obj`` on ``dst`` (None elsewhere)."""
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out
