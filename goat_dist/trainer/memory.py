"""Re-export (``trainer.py`` imports it from here): the measurement lives in ``goat_dist.engine.memory``."""

from ..engine.memory import training_state_bytes

__all__ = ["training_state_bytes"]
