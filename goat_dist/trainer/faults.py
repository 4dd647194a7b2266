"""Fault injection for the tests: ``GOAT_FAULT`` makes a chosen step fail in a chosen way (a NaN loss, a NaN
gradient, NaN weights, a crash mid-save), so the recovery paths run for real. Unset, nothing happens."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def fault_due(point: str, step: int, micro: int = 0, dp_rank: int = 0) -> bool:
    """Test hooks, ``GOAT_FAULT=<point>:<step>[:<micro>[:<dp_rank>]]`` (micro-batch and DP rank default to
    0; ``<step>`` may be a range ``a-b``). Points: ``nonfinite`` (a NaN in that micro-batch's loss),
    ``nonfinite_grad`` (a finite loss whose gradient is NaN),
    ``nonfinite_weights`` (a NaN written into the weights after that step's update), ``before_publish``,
    ``async_write`` (a crash while ``checkpoint.async``'s background writer writes that step's files),
    ``kill_after`` (every rank SIGKILLs itself once that step and its save are done: a ``kill -9`` that
    lands at a known step, however fast the machine trains)."""
    spec = os.environ.get("GOAT_FAULT", "").split(":")
    if spec[0] != point or len(spec) < 2:
        return False
    first, _, last = spec[1].partition("-")
    where = [int(x) for x in spec[2:]] + [0, 0]
    return int(first) <= step <= int(last or first) and (micro, dp_rank) == tuple(where[:2])


def fault_hook(point: str, step_dir: Path) -> None:
    """Test hook: ``GOAT_FAULT=before_publish:<step>`` kills the process after the shards of that step are
    written and before the checkpoint is published (a crash mid-save); ``async_write:<step>`` kills it in
    the middle of the background write of an async save."""
    if fault_due(point, int(step_dir.name.split("_")[1])):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_after(step: int) -> None:
    """Test hook: ``GOAT_FAULT=kill_after:<step>`` kills this rank at the end of that step."""
    if fault_due("kill_after", step):
        os.kill(os.getpid(), signal.SIGKILL)
