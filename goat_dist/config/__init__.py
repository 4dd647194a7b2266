"""Typed run configuration: dataclasses (``sections``), YAML files and dotted command-line overrides
(``loading``), checks naming the key at fault (``checks``).

``load_config("configs/tiny.yaml", ["train.max_steps=50", "model.goat.pos_rank=8"])`` returns a
validated ``Config``; unknown keys and wrong types raise ``ConfigError`` naming the key.

``model.vocab_size`` left out (or ``null`` / ``auto``) is the data set's: the largest ``vocab_size`` of
the manifests of ``data.source`` / ``data.sources`` (the model pads it as any vocabulary, see
``shapes.padded_vocab_size``). The builtin corpus, a generated task or a data set without a readable
manifest keep DEFAULT_VOCAB_SIZE (the builtin corpus trains its tokenizer to that size).

May import: yaml, ``goat_dist.atomic``, ``goat_dist.shapes`` and ``goat_dist.rampup`` (derived values);
never anything that builds on the configuration.
"""

from .checks import validate
from .loading import (
    RUN_CONFIG_HEADER,
    add_config_arguments,
    data_vocab_size,
    foreign_run_config,
    load_config,
    parse_override,
    save_config,
    save_run_config,
)
from .sections import *  # noqa: F403
from .sections import (
    ACTIVATION_CHECKPOINTING,
    ATTENTION_BACKENDS,
    DEFAULT_VOCAB_SIZE,
    EXPORT_DTYPES,
    PRECISIONS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    GoatConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "ATTENTION_BACKENDS",
    "DEFAULT_VOCAB_SIZE",
    "EXPORT_DTYPES",
    "PRECISIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GoatConfig",
    "LogConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "add_config_arguments",
    "data_vocab_size",
    "load_config",
    "parse_override",
    "save_config",
    "save_run_config",
    "foreign_run_config",
    "RUN_CONFIG_HEADER",
    "validate",
]
