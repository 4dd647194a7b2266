"""Measured per-rank bytes of training state: parameters, gradients, optimizer state.

Counted by walking the tensors the engine actually holds (model parameters and their ZeRO-3
partitions, ``.grad`` tensors, everything reachable from the optimizer wrapper), each storage counted
once. This is what ZeRO shards, so the numbers show its effect directly. The walk enters DeepSpeed's and
torch's objects only (the optimizer wrapper, its flat buffers and partitions), which is why it lives here.

A snapshot: where it is taken matters. After the accumulation boundary's backward (gradients reduced)
ZeRO-1 holds no gradient at all, while during the accumulation it holds every whole gradient; the
planner's peak is validated after non-final backwards (``tests/integration/plan/test_plan_validation.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from .zero3 import partition_tensor


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Counter:
    def __init__(self):
        self.seen: set[tuple[int, int]] = set()
        self.bytes = {"params": 0, "grads": 0, "optimizer": 0}

    def add(self, t, kind: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key[1] == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[kind] += key[1]

    def walk(self, obj, kind: str, depth: int = 0, visited: set | None = None) -> None:
        visited = set() if visited is None else visited
        if depth > 6 or id(obj) in visited or isinstance(obj, (str, bytes, int, float, nn.Module)):
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(obj, kind)
        elif isinstance(obj, dict):
            for v in obj.values():
                self.walk(v, kind, depth + 1, visited)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                self.walk(v, kind, depth + 1, visited)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
            for v in vars(obj).values():
                self.walk(v, kind, depth + 1, visited)


def training_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (plus their total)."""
    c = _Counter()
    for p in model.parameters():
        c.add(partition_tensor(p), "params")  # ZeRO-3 partition
        c.add(p.data, "params")
    for p in model.parameters():
        c.add(p.grad, "grads")
    c.walk(optimizer, "optimizer")
    return {**c.bytes, "total": sum(c.bytes.values())}
