"""Collective timeouts: a long one while this process's first step runs, the steady one after it.

Step 1 carries every cold compile: torch.compile of the blocks and FlashAttention-4's JIT of each kernel
shape, tens of seconds per shape, on every rank. A rank that compiles slower holds the others inside a
collective, so the process groups are made with ``parallel.startup_timeout_minutes`` (default 30) and the
hang watchdog (``trainer/signals.py``) waits as long; when this rank's first step has ended, every process
group it belongs to (the default group, megatron's and DeepSpeed's: torch.distributed's registry of groups)
and the watchdog switch to ``parallel.timeout_minutes``. On a resume, "step 1" is the first step of this
process. torchtitan does the same (``comm.init_timeout_seconds``, then ``comm.train_timeout_seconds`` set on
every group after its first step).

The switch is local, with no collective, and that is safe:

* A collective's timeout is what the waiting rank allows itself; peers need not agree on it. Each rank
  detects a lost peer on its own clock, so ranks holding different timeouts for a while only differ in how
  long each would wait.
* A rank switches after its step-1 control collective (``control.agree``) and optimizer step have
  completed, and that collective completes on a rank only once every rank has entered it: every rank is
  then past step 1's forward and backward passes, the compiles included. A rank that has switched waits
  with the steady timeout only for peers that have left their compiles behind; a peer that has not
  switched yet still allows itself the long one, which is only more patient.

``Timeouts`` holds the two values and which applies; ``set_group_timeouts`` sets one on every group and
``group_timeout`` reads one back (tests, logs).
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

STARTUP_KEY = "parallel.startup_timeout_minutes"
STEADY_KEY = "parallel.timeout_minutes"


def process_groups() -> list[Any]:
    """Every process group this rank belongs to: torch.distributed's registry of groups (the default group,
    megatron's, DeepSpeed's), read through c10d's internals (``_world.pg_map``). Where a torch version has
    no such registry, the default group alone, with a warning that the other groups keep their timeout."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    registry = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if registry is None:
        warnings.warn(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d._world.pg_map: only the "
            "default process group's collective timeout is switched; megatron's and DeepSpeed's groups keep "
            "the one they were made with",
            stacklevel=2,
        )
        return [c10d._get_default_group()]
    return list(registry)


def _backends(group) -> list[Any]:
    """The backends (one per device type, shared ones once) that carry ``group``'s collectives."""
    found: dict[int, Any] = {}
    for device in getattr(group, "_device_types", None) or [torch.device("cpu")]:
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # no backend for that device type
            continue
        found[id(backend)] = backend
    return list(found.values())


def set_group_timeouts(minutes: float) -> int:
    """Set the collective timeout of every process group of this rank (``process_groups``) to ``minutes``;
    returns how many backends took it (gloo and NCCL do; a backend without a timeout, such as torch's fake
    one, is left alone). No collective: each rank sets its own."""
    timeout = datetime.timedelta(minutes=minutes)
    changed = 0
    for group in process_groups():
        for backend in _backends(group):
            setter = getattr(backend, "_set_default_timeout", None)
            if setter is not None:
                setter(timeout)
                changed += 1
    return changed


def group_timeout(group=None) -> datetime.timedelta | None:
    """The collective timeout ``group`` (default: the default group) holds, read back from its first backend
    that has options (gloo's and NCCL's ``options._timeout``); None when none says."""
    if group is None:
        group = dist.group.WORLD
    for backend in _backends(group):
        options = getattr(backend, "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None


@dataclass
class Timeouts:
    """The start-up and steady collective timeouts (minutes) and which one applies now."""

    startup_minutes: float
    steady_minutes: float
    steady: bool = False  # this process's first step has ended

    @classmethod
    def from_config(cls, parallel) -> Timeouts:
        return cls(parallel.startup_timeout_minutes, parallel.timeout_minutes)

    @property
    def minutes(self) -> float:
        """The timeout that applies now."""
        return self.steady_minutes if self.steady else self.startup_minutes

    @property
    def key(self) -> str:
        """The config key of the timeout that applies now."""
        return STEADY_KEY if self.steady else STARTUP_KEY

    def describe(self) -> str:
        """``key=value`` of the timeout that applies now."""
        return f"{self.key}={self.minutes:g}"

    def begin(self) -> int:
        """Before this process's first step: every group gets the start-up timeout, the groups made after
        the process groups' start (DeepSpeed's, made with torch's default timeout) included."""
        self.steady = False
        return set_group_timeouts(self.startup_minutes)

    def first_step_done(self) -> int:
        """After this rank's first step: every group gets the steady timeout (see the module's docstring
        for why no collective is needed)."""
        self.steady = True
        return set_group_timeouts(self.steady_minutes)
