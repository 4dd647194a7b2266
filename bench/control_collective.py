"""The per-step control collective's cost (``trainer.control.agree``): microseconds per call on a world of
``--nproc`` processes on this machine (gloo on CPU, NCCL where CUDA is present), median of ``--calls``.

    python bench/control_collective.py --nproc 2
    git show REV:goat_dist/trainer/control.py > /tmp/control_rev.py
    python bench/control_collective.py --nproc 2 --agree-from /tmp/control_rev.py   # another version
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time


def load_agree(path: str | None):
    if path is None:
        from goat_dist.trainer.control import agree

        return agree
    spec = importlib.util.spec_from_file_location("control_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.agree


def worker(rank: int, nproc: int, port: int, calls: int, path: str | None, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    agree = load_agree(path)
    loss, bad = torch.tensor(8.0, device=device), torch.tensor(0, device=device)
    times = []
    for i in range(calls + 20):  # 20 warm-up calls
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        agree(loss, 4, bad, bad.float(), 12345 + i, 0, 512, False, False, False, tp=1, dp=nproc)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times) * 1e6)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from goat_dist.distributed import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--agree-from", help="a control.py file to time instead of this checkout's")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.nproc, port, args.calls, args.agree_from, out))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    while out.empty():  # a worker that failed has printed why: stop waiting
        if any(p.exitcode not in (None, 0) for p in procs):
            raise SystemExit("a worker failed (see above)")
        time.sleep(0.1)
    median_us = out.get()
    for p in procs:
        p.join()
    print(f"control collective ({args.agree_from or 'this checkout'}): {median_us:.1f} us per step (median)")


if __name__ == "__main__":
    main()
