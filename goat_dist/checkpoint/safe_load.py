"""Reading checkpoints back without running code from them.

DeepSpeed's checkpoint engines call ``torch.load(..., weights_only=False)``, which unpickles arbitrary
objects: a checkpoint directory written by someone else could run code on resume (the manifest does not
help: it is not signed and can be rewritten). While ``safe_loading`` is active, every ``torch.load`` in the
process, DeepSpeed's included, is forced to ``weights_only=True`` with an explicit allow-list of the few
non-tensor types DeepSpeed's files hold. A refused global raises ``CheckpointError`` naming the file, the
step and the type; nothing from the file runs. Everything else the project reads back is safetensors or
JSON (universal state, exports, manifests) or goes through ``load`` below (RNG states).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import pickle
import re
import threading
from pathlib import Path

import torch

from .errors import CheckpointError

_lock = threading.Lock()


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a type outside the allow-list (possibly code); it was not loaded."""


def allowed_globals() -> list:
    """The non-tensor types DeepSpeed writes into its model/optimizer files (ZeRO 0-3, fp32 and bf16)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address, collections.OrderedDict, argparse.Namespace, set]


def _refused_type(error: Exception) -> str:
    match = re.search(r"(?:Unsupported global|GLOBAL)\s*:?\s*(?:GLOBAL\s+)?([\w.]+(?:\s[\w.]+)?)", str(error))
    return match.group(1) if match else type(error).__name__


def load(f, step: int | None = None, map_location=None, mmap: bool = False):
    """``torch.load`` restricted to tensors, containers and the allow-listed types."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return _ORIGINAL_LOAD(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        at = f" (step {step})" if step is not None else ""
        name = f if isinstance(f, (str, Path)) else getattr(f, "name", "a checkpoint stream")
        raise UnsafeCheckpointError(
            f"refused to load {name}{at}: it holds the type '{_refused_type(e)}', which is not on the "
            "allow-list of checkpoint contents (only tensors, containers, numbers, strings and a few "
            "DeepSpeed types are). Nothing from the file was executed. If you wrote this checkpoint "
            "yourself with another DeepSpeed version, report the type."
        ) from None


_ORIGINAL_LOAD = torch.load


def scan(step_dir: Path, step: int | None = None) -> None:
    """Check every torch file of a checkpoint against the allow-list before any rank loads one.

    Memory-mapped, so only the pickled structure is read, not the tensor data. Raises
    ``UnsafeCheckpointError`` for the first refused file."""
    for path in sorted(Path(step_dir).rglob("*.pt")):
        load(path, step, map_location="cpu", mmap=True)


@contextlib.contextmanager
def safe_loading(step: int | None = None):
    """Within the block, every ``torch.load`` (DeepSpeed's too) is ``load`` above, whatever it asks for."""

    def guarded(f, map_location=None, *args, **kwargs):  # weights_only and pickle options are ignored
        return load(f, step, map_location)

    with _lock:
        torch.load = guarded
        try:
            yield
        finally:
            torch.load = _ORIGINAL_LOAD
