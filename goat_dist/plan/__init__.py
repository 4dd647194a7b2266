"""Plan a run before spending GPU hours: per-GPU memory (parameters, gradients, optimizer state per ZeRO
stage, activations), the largest micro-batch that fits, estimated step time and MFU, what a checkpoint
costs, the fastest layouts that fit a cluster (``search``), and a dry run that builds the real model and
optimizer of a large world on one CPU box. See ``docs/planner.md``.

May import: torch (the dry run builds on the meta device), ``goat_dist.config``, ``goat_dist.shapes``,
``goat_dist.precision``, ``goat_dist.rampup``, ``goat_dist.distributed``, ``goat_dist.optim``,
``goat_dist.model``, ``goat_dist.observe`` (FLOPs) and ``goat_dist.engine`` (only ``engine.sizes``: the
buffer sizes and stage rules the engine is built with, importing nothing); never the trainer or the
engine's internals.
"""

from .checkpoint import checkpoint_cost
from .memory import activation_bytes, param_inventory, state_bytes, total_params, transient_bytes
from .planner import format_plan, make_plan
from .search import format_search, search

__all__ = [
    "activation_bytes",
    "checkpoint_cost",
    "format_plan",
    "format_search",
    "make_plan",
    "param_inventory",
    "search",
    "state_bytes",
    "total_params",
    "transient_bytes",
]
