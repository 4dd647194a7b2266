"""``run_distributed``: run a rank function on a real multi-process gloo world and return what each rank
returned, so that the function sits next to the assertion that checks it.

Each rank is a fresh spawned interpreter (nothing of the test process's torch or megatron state leaks in)
with its own ``/proc/self/io`` counters. It sets the launcher variables torchrun would, calls
``goat_dist.distributed.init(tp, cp)`` and then ``fn(layout, *args)``; the return value travels back
pickled through a multiprocessing queue (test-process-only data: these are the test's own objects).
A rank that raises fails the call with that rank's traceback; a world that does not finish within
``timeout_s`` after every rank has initialised (``startup_s`` allows for the start itself: imports on a
loaded machine take a while) is killed and fails the call, so a hang is a test failure, not a stuck suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["DistributedFailure", "run_distributed"]


class DistributedFailure(AssertionError):
    """A rank of a ``run_distributed`` world raised, exited without a result, or the world timed out."""


def _rank_main(fn, rank: int, world: int, port: int, tp: int, cp: int, args: tuple, env: dict, results):
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    import warnings

    warnings.filterwarnings("ignore")
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        from goat_dist import distributed

        layout = distributed.init(tp=tp, cp=cp)
        results.put((rank, "started", None))
        results.put((rank, "ok", fn(layout, *args)))
    except BaseException:  # noqa: BLE001 (every failure goes back to the test with its traceback)
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()  # the result is in the pipe before this process goes
    sys.stdout.flush()
    sys.stderr.flush()
    # no teardown barrier after an error (the other ranks may never reach it); os._exit skips the
    # DeepSpeed/gloo teardown races that can abort an interpreter at exit (distributed.exit_process)
    if code == 0:
        from goat_dist import distributed

        distributed.teardown()
    os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    world: int = 2,
    tp: int = 1,
    cp: int = 1,
    args: tuple = (),
    timeout_s: float = 300.0,
    startup_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(layout, *args)`` on ranks 0..world-1 of a gloo world with TP ``tp`` and CP ``cp``; the list of
    their return values in rank order. ``fn`` must be importable by name (a module-level function of a
    test module or of ``harness``); its arguments and results must pickle."""
    from goat_dist.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world, port, tp, cp, tuple(args), dict(env or {}), results),
            name=f"rank{rank}",
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    started: set[int] = set()
    try:
        deadline = time.monotonic() + startup_s
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode is not None and int(p.name[4:]) not in got]
                if dead or time.monotonic() > deadline:
                    break
                continue
            if status == "started":
                started.add(rank)
                if len(started) == world:  # the function's own time starts now
                    deadline = time.monotonic() + timeout_s
                continue
            got[rank] = (status, value)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if errors:
        rank = min(errors)
        raise DistributedFailure(f"rank {rank} of {world} raised:\n{errors[rank]}")
    missing = [r for r in range(world) if r not in got]
    if missing:
        codes = {p.name: p.exitcode for p in procs}
        if len(started) < world:
            late = [r for r in range(world) if r not in started]
            raise DistributedFailure(f"ranks {late} of {world} did not initialise within {startup_s:g} s")
        raise DistributedFailure(
            f"ranks {missing} of {world} returned nothing within {timeout_s:g} s (exit codes {codes})"
        )
    return [got[r][1] for r in range(world)]
