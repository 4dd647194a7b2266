"""DeepSpeed-driven training of the megatron-core GPT."""

from .entry import run
from .state import RunState
from .trainer import Trainer

__all__ = ["RunState", "Trainer", "run"]
