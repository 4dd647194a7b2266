"""The disk check: free space on the run dir's file system for the next checkpoint, estimated from the
model's parameter count (``goat_dist.shapes``: no model is built, no megatron imported)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..shapes import total_params
from .report import Report, _human

# Bytes per parameter of one checkpoint: every rank writes its share of the fp32 master weights and Adam's
# two moments (12 B, in bf16 and fp32 training alike; ``plan/checkpoint.py`` has the per-rank arithmetic).
BYTES_PER_PARAM = 12
DISK_HEADROOM = 1.10  # manifests, RNG states, config copies, file-system slack


def parameter_count(model_cfg, tp: int = 1) -> int:
    """Parameters of ``GPT(model_cfg)`` summed over all tensor-parallel ranks (replicated ones once, the
    vocabulary padded for ``tp`` ranks), computed from the config (no model is built; tests check it
    against a real model)."""
    return total_params(model_cfg, tp)


def checkpoint_bytes(cfg) -> int:
    """Estimated bytes of one whole checkpoint of ``cfg`` (a ``Config``): parameters x 12 B (fp32 masters
    and two Adam moments; each rank writes its share)."""
    return parameter_count(cfg.model, cfg.parallel.tp) * BYTES_PER_PARAM


def next_checkpoint_bytes(cfg) -> int:
    """The room one checkpoint of ``cfg`` asks for: ``checkpoint_bytes`` with DISK_HEADROOM (the doctor's
    disk check, and the trainer's at start)."""
    return int(checkpoint_bytes(cfg) * DISK_HEADROOM)


def check_disk(report: Report, cfg, run_dir: Path) -> None:
    need = next_checkpoint_bytes(cfg)
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    params = parameter_count(cfg.model, cfg.parallel.tp)
    what = f"next checkpoint ~{_human(need)} ({params:,} params); {_human(free)} free on {probe}"
    if free < need:
        report.fail("disk", f"not enough space: {what}")
    else:
        report.ok("disk", what)
