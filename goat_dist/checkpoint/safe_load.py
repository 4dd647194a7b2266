"""Reading checkpoint torch files back without running code from them.

A checkpoint's state is safetensors and JSON (``universal.py``); the only torch files read back are the
per-rank RNG states (``rng_rank<R>.pt``). They are loaded with ``torch.load(weights_only=True)`` and no
extra allowed type: a file swapped for a malicious pickle (the manifest is no defence: it is not signed and
can be rewritten) raises ``UnsafeCheckpointError`` naming the file, the step and the refused type, and
nothing from it runs. ``check_everywhere`` makes every rank load its own file first, so one rank's refused
file stops all ranks together instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from .errors import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a type outside tensors and containers (possibly code); it was not loaded."""


def _refused_type(error: Exception) -> str:
    match = re.search(r"(?:Unsupported global|GLOBAL)\s*:?\s*(?:GLOBAL\s+)?([\w.]+(?:\s[\w.]+)?)", str(error))
    return match.group(1) if match else type(error).__name__


def load(f, step: int | None = None, map_location=None, mmap: bool = False):
    """``torch.load`` restricted to tensors, containers, numbers and strings."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        at = f" (step {step})" if step is not None else ""
        name = f if isinstance(f, (str, Path)) else getattr(f, "name", "a checkpoint stream")
        raise UnsafeCheckpointError(
            f"refused to load {name}{at}: it holds the type '{_refused_type(e)}', which a checkpoint's torch "
            "files never hold (only tensors, containers, numbers and strings are loaded). Nothing from the "
            "file was executed."
        ) from None
