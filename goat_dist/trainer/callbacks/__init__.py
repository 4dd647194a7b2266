"""Callbacks keep the loop short: the trainer's own jobs and the loggers live here (``base`` lists the
events). Jobs, on every rank: ``Throughput`` (the logged metrics), ``Evaluation``, ``PriorPictures``,
``Checkpointing``, ``MemoryUse``. Loggers, on the main rank: ``ConsoleLogger``, ``JsonlLogger``,
``TensorBoardLogger``. The user's own: ``train.callbacks`` (``plugins``)."""

from .banner import start_info
from .base import Callback
from .checkpointing import Checkpointing
from .evaluation import Evaluation
from .loggers import ConsoleLogger, JsonlLogger, TensorBoardLogger
from .memory import MemoryUse
from .plugins import load_callbacks
from .prior import PriorPictures
from .throughput import Throughput

__all__ = [
    "Callback",
    "Checkpointing",
    "ConsoleLogger",
    "Evaluation",
    "JsonlLogger",
    "MemoryUse",
    "PriorPictures",
    "TensorBoardLogger",
    "Throughput",
    "load_callbacks",
    "start_info",
]
