"""Callbacks keep the loop short: the trainer's own jobs and the loggers live here (``base`` lists the
events and how a callback's state survives a resume; ``api`` is what a callback sees of the trainer,
``TrainerAPI``). Jobs, on every rank: ``Throughput`` (the logged metrics), ``Evaluation``,
``PriorPictures``, ``Checkpointing``, ``MemoryUse``, ``Profiler`` (``log.profile_steps``). Loggers, on the
main rank: ``ConsoleLogger``, ``JsonlLogger``, ``TensorBoardLogger``. The user's own: ``train.callbacks``
(``plugins``)."""

from .api import DataPosition, TrainerAPI
from .banner import start_info
from .base import Callback
from .checkpointing import Checkpointing
from .evaluation import Evaluation
from .loggers import ConsoleLogger, JsonlLogger, TensorBoardLogger
from .memory import MemoryUse
from .plugins import load_callbacks
from .prior import PriorPictures
from .profiler import Profiler
from .throughput import Throughput

__all__ = [
    "Callback",
    "Checkpointing",
    "ConsoleLogger",
    "DataPosition",
    "Evaluation",
    "JsonlLogger",
    "MemoryUse",
    "PriorPictures",
    "Profiler",
    "TensorBoardLogger",
    "Throughput",
    "TrainerAPI",
    "load_callbacks",
    "start_info",
]
