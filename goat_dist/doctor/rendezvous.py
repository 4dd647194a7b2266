"""The collective checks: joining the process group (rendezvous), a correct and timed all-reduce
(algorithm and bus bandwidth as nccl-tests define them), and that the run dir is one directory on every
node (a token rank 0 writes, read by each node's first rank)."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

from .report import Report, _human


def init_world(report: Report, device, timeout_s: float) -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    try:
        if "RANK" in os.environ:
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        else:
            from ..distributed import free_port

            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=timeout_s),
            )
    except Exception as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        report.fail(
            "rendezvous",
            f"cannot join the {backend} process group at {where} within {timeout_s:.0f} s: "
            f"{type(e).__name__}: {e}",
        )
        return False
    return True


def check_all_reduce(report: Report, device, nbytes: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from .. import collectives

    world, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    probe = torch.full((4,), float(rank + 1), device=device)
    collectives.all_reduce(probe)
    expected = world * (world + 1) / 2
    if not torch.allclose(probe.cpu(), torch.full((4,), expected)):
        report.fail("all-reduce", f"wrong result: {probe.tolist()} instead of {expected} ({backend})")
        return
    n = max(1, nbytes // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    collectives.all_reduce(buf)  # warm-up: connections, NCCL channels
    sync()
    times = []
    for _ in range(iters):
        collectives.all_reduce(torch.zeros(1, device=device))  # start together
        sync()
        t0 = time.perf_counter()
        collectives.all_reduce(buf)
        sync()
        times.append(time.perf_counter() - t0)
    # every rank's slowest view counts: the max over ranks of the median time
    median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    collectives.all_reduce(median, op="max")
    seconds = float(median.item())
    if world == 1:
        report.ok("all-reduce", f"1 rank, {backend}: correct (no link to measure)")
        return
    algbw = n * 4 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    report.bandwidth = {"bytes": n * 4, "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": busbw}
    report.ok(
        "all-reduce",
        f"{world} ranks, {backend}, {_human(n * 4)} x {iters}: {seconds * 1e3:.1f} ms, "
        f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
    )


def _agree(device, value: int, op: str = "max") -> int:
    import torch

    from .. import collectives

    t = torch.tensor([value], dtype=torch.int64, device=device)
    collectives.all_reduce(t, op="max" if op == "max" else "sum")
    return int(t.item())


def check_shared_run_dir(report: Report, device, run_dir: Path, local_rank: int, writable: bool) -> None:
    """Rank 0 writes a token; every node's first rank must read it: the run dir is the same directory."""
    import torch.distributed as dist

    rank = dist.get_rank()
    token = uuid.uuid4().hex
    path = run_dir / ".doctor-shared"
    if rank == 0 and writable:
        try:
            path.write_text(token)
        except OSError:
            writable = False
    # every rank learns rank 0's token through a collective (as an integer) and whether it was written
    tok_int = int(token[:15], 16) if rank == 0 and writable else 0
    expected = _agree(device, tok_int)
    if expected and local_rank == 0 and rank != 0:
        try:
            seen = int(path.read_text()[:15], 16)
        except (OSError, ValueError):
            seen = -1
        if seen != expected:
            report.fail(
                "run dir",
                f"{run_dir} is not the directory rank 0 writes to (not on a file system shared by all "
                "nodes?): checkpoints would be incomplete",
            )
    _agree(device, 0)
    if rank == 0 and expected:
        path.unlink(missing_ok=True)
