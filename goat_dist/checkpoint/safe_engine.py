"""DeepSpeed's checkpoint engine, reading back with ``torch.load(weights_only=True)``.

DeepSpeed's own engine unpickles arbitrary objects. Its checkpoints hold tensors, containers, numbers,
strings and a few DeepSpeed/torch types, which are allowed explicitly here; anything else fails to load
instead of executing.
"""

from __future__ import annotations

import argparse
import collections

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def _allowed_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address, collections.OrderedDict, argparse.Namespace, set]


class SafeCheckpointEngine(TorchCheckpointEngine):
    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)


def install(engine) -> None:
    """Swap the engine's checkpoint engine for the safe one (same save format)."""
    engine.checkpoint_engine = SafeCheckpointEngine(getattr(engine, "_config", None))
