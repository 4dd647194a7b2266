"""Starting goat-dist processes from Python: one process, or a local torchrun world.

Tests, benchmarks and tools launch training in subprocesses; a child must not inherit the launcher
variables of a parent world (they would hijack its rendezvous), and DeepSpeed should be told its
accelerator instead of guessing. Arguments are passed as lists, never through a shell.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from .distributed import free_port, launch_environment

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
        "GOAT_LAUNCHER_PID",  # lifeline.LAUNCHER_PID_VAR: a child world has a launcher of its own
        "GOAT_NODE_LOCAL_RANK",  # distributed.NODE_LOCAL_RANK: the parent's place on its node
    }
)


def child_env(base: dict | None = None, **extra: str) -> dict:
    """``base`` (default: this environment) without a parent world's launcher variables, plus ``extra``;
    ``DS_ACCELERATOR`` defaults to this machine's (cuda where a GPU is visible)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LAUNCHER_VARS}
    env.setdefault("DS_ACCELERATOR", _accelerator())
    env.update(extra)
    return env


def worker_env(base: dict | None = None) -> dict:
    """A training worker's environment (``goat-dist train --nproc``): ``child_env`` plus what every
    launcher exports before Python starts (``distributed.launch_environment``: one CUDA connection,
    the allocator's expandable segments, NCCL's async error handling), a value ``base`` sets kept."""
    env = child_env(base)
    return {**env, **launch_environment(env)}


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


# the exit codes a worker uses on purpose (a usage error, a checkpointed stop, an abort by a second Ctrl-C):
# passed on as they are
PASSED_ON = {2, 75, 130}

# what run_world passes on to its workers itself (torch's agent would turn them into SIGTERM, SIGKILL after
# 30 s, and a traceback); SIGHUP and SIGQUIT stay with the agent
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def _forward_to_workers(signum, frame) -> None:
    """A stop request for the world: the same signal to every worker (Ctrl-C reaches only this process,
    the agent starts each worker in a session of its own); the agent then sees them exit. Before any
    worker exists there is nothing to stop: this process ends (KeyboardInterrupt)."""
    import psutil

    workers = psutil.Process().children()
    if not workers:
        raise KeyboardInterrupt
    for worker in workers:
        try:
            worker.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def run_world(nproc: int, args: list[str]) -> int:
    """Run ``python <args>`` as a local world of ``nproc`` processes (torchrun's agent, in this process)
    and return an exit code the caller can act on.

    The command-line torchrun turns every worker failure into exit 1 plus a ChildFailedError traceback;
    here a failure whose first worker exited 2 (an error of the user's, already printed once by rank 0),
    75 (checkpointed) or 130 (aborted) exits with that code and nothing more; any other failure is named
    in one line. Ctrl-C (SIGINT), SIGTERM and SIGUSR1 go to every worker as they are: the workers save a
    checkpoint at the next step boundary and stop, and this process exits 75 as rank 0 does; a second
    Ctrl-C aborts them. The workers die with this process (``lifeline``: ``GOAT_LAUNCHER_PID``); they
    start with ``worker_env``'s variables."""
    if nproc == 1:
        import subprocess

        return subprocess.call([sys.executable, *args], env=worker_env())
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from .lifeline import LAUNCHER_PID_VAR

    os.environ.update({k: v for k, v in worker_env().items() if k not in os.environ})
    for var in LAUNCHER_VARS & set(os.environ):
        del os.environ[var]
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
    config, cmd, cmd_args = config_from_args(
        parse_args(
            [
                f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}",
                f"--signals-to-handle={AGENT_SIGNALS}",
                "--no-python",
                sys.executable,
                *args,
            ]
        )
    )
    agent_log = logging.getLogger("torch.distributed.elastic")
    agent_log.setLevel(logging.CRITICAL)  # its lines restate a failure the worker already explained
    previous = {sig: signal.signal(sig, _forward_to_workers) for sig in FORWARDED}
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in PASSED_ON:
            return failure.exitcode
        print(f"goat-dist: rank {rank} of {nproc} failed with exit code {failure.exitcode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("goat-dist: interrupted before the workers started", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
