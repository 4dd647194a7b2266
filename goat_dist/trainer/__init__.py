"""Training the megatron-core GPT through the engine: the loop (``trainer.py``: events, one per-step
collective in ``control.py``), its side work as callbacks (``callbacks/``: checkpointing, evaluation,
prior pictures, throughput, memory, loggers, ``train.callbacks`` plugins), the run state, non-finite and
unreadable steps, signals and the deadline, and ``goat-dist train``'s entry (``entry.py``:
``last_exit.json``).

May import: everything below it: ``goat_dist.atomic``, ``goat_dist.collectives``, ``goat_dist.config``,
``goat_dist.precision``, ``goat_dist.rampup``, ``goat_dist.distributed``, ``goat_dist.data``,
``goat_dist.engine``, ``goat_dist.model``, ``goat_dist.parallel``, ``goat_dist.observe``,
``goat_dist.checkpoint``, ``goat_dist.run_lock`` (one trainer per run dir) and ``goat_dist.doctor`` (the
recorded write bandwidth); only the command line
imports the trainer.
"""

from .entry import run
from .state import RunState
from .trainer import Trainer

__all__ = ["RunState", "Trainer", "run"]
