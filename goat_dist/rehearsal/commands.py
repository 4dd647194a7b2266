"""The rehearsal on the command line: ``goat-dist plan --rehearse`` (``plan_rehearsal``) and the preflight
check of ``goat-dist doctor`` on a GPU node (``doctor_check``). ``cli`` hands both to those commands."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .rank import RehearsalError
from .run import format_rehearsal, rehearse

DOCTOR_LAYERS = 2  # the doctor rehearses a cut model: seconds, not minutes


def plan_rehearsal(cfg, args, world: int, device) -> int:
    """``--rehearse``: the report, and exit 0 only when the rehearsal is clean (2 names every fault)."""
    try:
        result = rehearse(cfg, world, device, rank=args.rank, layers=args.layers, name=Path(args.config).name)
    except (RehearsalError, ValueError) as e:
        print(f"goat-dist plan: {e}", file=sys.stderr)
        return 2
    print(format_rehearsal(result), flush=True)
    return 0 if result.clean else 2


def node_gpu():
    """The planner's GPU for this node's device (by name, else by compute capability), or H100 without
    CUDA (a rehearsal asked for on a CPU machine)."""
    import torch

    from ..plan.hardware import GPUS, gpu

    if not torch.cuda.is_available():
        return gpu("h100-80gb")
    name = torch.cuda.get_device_name()
    capability = tuple(torch.cuda.get_device_capability())
    by_name = [g for g in GPUS.values() if g.cuda_name == name]
    by_capability = [g for g in GPUS.values() if g.capability == capability]
    return (by_name or by_capability or [gpu("h100-80gb")])[0]


def doctor_check(report, cfg, environ) -> None:
    """``goat-dist doctor``'s rehearsal, once per node (local rank 0), before any process group exists:
    the node's last rank (the one holding the most of the node: the last TP rank) of the job's world
    (``WORLD_SIZE``), cut to ``DOCTOR_LAYERS`` blocks, on this node's GPU. A fault fails the preflight,
    named; the job then never starts a step that would crash or stall on the GPU."""
    if int(environ.get("LOCAL_RANK", 0)) != 0:
        return
    world = int(environ.get("WORLD_SIZE", 1))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", 1))
    rank = min(int(environ.get("RANK", 0)) + local_world - 1, world - 1)
    t0 = time.perf_counter()
    device = node_gpu()
    try:
        result = rehearse(cfg, world, device, rank=rank, layers=DOCTOR_LAYERS, memory=False, name="config")
    except Exception as e:  # the rehearsal could not run: say so, naming why (the job may still be fine)
        report.fail("rehearsal", f"could not rehearse rank {rank} of {world}: {type(e).__name__}: {e}")
        return
    seconds = time.perf_counter() - t0
    what = (
        f"rank {rank} of {world} on {device.name}, {result.layers} of {result.full_layers} blocks, "
        f"attention {result.run.backend}: {result.syncs_per_step} host sync(s) per step ({seconds:.1f} s)"
    )
    if result.clean:
        report.ok("rehearsal", what)
        return
    for fault in result.faults:
        report.fail("rehearsal", f"{fault} ({what})")
