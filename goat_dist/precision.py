"""The precision policy, resolved in one place: what ``train.precision`` (or ``eval --precision``) means
on a device, its torch dtype, and the autocast context a forward pass runs in.

``auto`` is the engine's bf16 mode on CUDA (fp32 masters, the fp32 GOAT prior: the tested bf16 path) and
fp32 on a CPU. The trainer resolves it once, before anything reads it, so that the engine, autocast, the
checkpoint's layout record and the saved config all see the same concrete precision; evaluation, the MFU
peak (``observe.peak``) and the planner (which plans for GPUs) resolve it here too, so none of them can
mean something else by ``auto``.

torch is imported only by the functions that return torch objects: the resolution itself works without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}  # concrete precision -> torch dtype attribute


def device_type(device: Any) -> str:
    """``"cuda"``, ``"cpu"``, ...: the type of a ``torch.device`` or of a device name like ``"cuda:1"``."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def resolve_precision(precision: str, device: Any) -> str:
    """The concrete precision (``bf16`` or ``fp32``) of ``precision`` on ``device`` (a ``torch.device``
    or a device type / name such as ``"cuda"``, ``"cuda:1"``, ``"cpu"``): ``auto`` is bf16 on CUDA and
    fp32 elsewhere; any other value is already concrete and is returned as it is."""
    if precision != "auto":
        return precision
    return "bf16" if device_type(device) == "cuda" else "fp32"


def torch_dtype(precision: str, device: Any = "cpu"):
    """The ``torch.dtype`` of ``precision`` on ``device`` (``auto`` resolved first)."""
    import torch

    return getattr(torch, DTYPE_NAMES[resolve_precision(precision, device)])


def autocast_for(precision: str, device: Any) -> Callable[[], contextlib.AbstractContextManager]:
    """A zero-argument factory of the context every forward pass of ``precision`` on ``device`` runs
    in: ``torch.autocast`` to bf16 under bf16, a null context under fp32."""
    if resolve_precision(precision, device) == "bf16":
        import torch

        return lambda: torch.autocast(device_type(device), dtype=torch.bfloat16)
    return contextlib.nullcontext


def autocast_context(cfg, device) -> Callable[[], contextlib.AbstractContextManager]:
    """``autocast_for`` of a ``Config``'s ``train.precision``."""
    return autocast_for(cfg.train.precision, device)
