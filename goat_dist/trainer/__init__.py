"""DeepSpeed-driven training of the megatron-core GPT."""

from .state import RunState
from .trainer import Trainer, run

__all__ = ["RunState", "Trainer", "run"]
