"""Model build time per rank: ``GPT(...)`` for one rank of a TP world, on the CPU.

The world is torch's fake process group (one process playing rank 0 of ``--tp`` ranks, no traffic), so a
layout of any size is timed on one machine; the time is what each rank of a real world spends building
and initialising its shard of the model. Prints seconds, the rank's parameters and parameters/s.

    python bench/startup.py --config configs/models/goat_1.3b.yaml --tp 8
"""

from __future__ import annotations

import argparse
import os
import time
import warnings


def build_seconds(config: str, tp: int, repeats: int) -> tuple[float, int]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from goat_dist import distributed
    from goat_dist.config import load_config
    from goat_dist.model import GPT

    cfg = load_config(config, [])
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=tp)
    distributed.init(tp=tp)
    best = float("inf")
    for _ in range(repeats):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        model = GPT(cfg.model)
        best = min(best, time.perf_counter() - t0)
        params = sum(p.numel() for p in model.parameters())
        del model
    return best, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/models/goat_1.3b.yaml")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="the best of this many builds")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seconds, params = build_seconds(args.config, args.tp, args.repeats)
    print(
        f"{args.config} TP={args.tp}: {seconds:.2f} s per rank to build {params / 1e6:.1f}M parameters "
        f"({params / seconds / 1e6:.1f}M params/s of its shard)"
    )


if __name__ == "__main__":
    main()
