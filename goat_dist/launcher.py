"""Starting goat-dist processes from Python: one process, or a local torchrun world.

Tests, benchmarks and tools launch training in subprocesses; a child must not inherit the launcher
variables of a parent world (they would hijack its rendezvous), and DeepSpeed should be told its
accelerator instead of guessing. Arguments are passed as lists, never through a shell.
"""

from __future__ import annotations

import os
import sys

from .distributed import free_port

# what torchrun/Slurm launchers set for a worker; a child world must start without them
LAUNCHER_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
    }
)


def child_env(base: dict | None = None, **extra: str) -> dict:
    """``base`` (default: this environment) without a parent world's launcher variables, plus ``extra``;
    ``DS_ACCELERATOR`` defaults to this machine's (cuda where a GPU is visible)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LAUNCHER_VARS}
    env.setdefault("DS_ACCELERATOR", _accelerator())
    env.update(extra)
    return env


def _accelerator() -> str:
    """DeepSpeed's accelerator for a child on this machine: cuda where a GPU is visible, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def launch_command(nproc: int, args: list[str]) -> list[str]:
    """``python <args>`` for one process, ``torchrun --nproc_per_node=N <args>`` (a free port) for more."""
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *args,
    ]
