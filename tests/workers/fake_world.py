"""Worlds of one process playing one rank (torch's "fake" backend: no peers, no traffic).

    python tests/workers/fake_world.py WORLD TP RUN_DIR   # groups
    python tests/workers/fake_world.py init TP RANK        # shard init

groups: ``distributed.init`` on a simulated CUDA machine; one JSON line with the backend every process
group was created with, and the environment the run set for NCCL. init: a GPT built as rank RANK of a
TP world, against the same GPT built at TP=1; one JSON line with the TP-split parameters whose shard
differs from its slice of the TP=1 weight, and the values the shard build drew against its size.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from goat_dist import distributed


def main(world: int, tp: int, run_dir: str) -> None:
    created: list[str] = []  # the backend string of every group, the world's first
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, timeout=None, **kwargs):
        created.append(backend)
        real_init(backend="fake", store=FakeStore(), rank=0, world_size=world, timeout=timeout)

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        created.append(backend or created[0])  # no backend: torch gives it the world's
        return real_new_group(ranks=ranks, timeout=timeout, backend="fake", **kwargs)

    torch.cuda.is_available = lambda: True
    torch.cuda.set_device = lambda device: None
    distributed.apply_cpu_compat = lambda: False
    dist.init_process_group, dist.new_group = init_process_group, new_group
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    layout = distributed.init(tp=tp, run_dir=run_dir)
    keys = [k for k in os.environ if k.startswith(("TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS"))]
    print(
        "FAKE_WORLD",
        json.dumps(
            {
                "world": layout.world,
                "tp": layout.tp,
                "dp": layout.dp,
                "backends": created,
                "env": {k: os.environ[k] for k in keys},
            }
        ),
    )


def shard_init(tp: int, rank: int) -> None:
    from megatron.core import parallel_state

    from goat_dist.compat import apply_cpu_compat
    from goat_dist.config import ModelConfig
    from goat_dist.model import GPT

    apply_cpu_compat()
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=tp)
    cfg = ModelConfig(
        vocab_size=2048, seq_len=32, num_layers=2, hidden_size=256, num_heads=4, position="goat", bias=True
    )
    drawn = [0]
    normal = torch.Tensor.normal_

    def counting(self, *args, **kwargs):
        drawn[0] += self.numel()
        return normal(self, *args, **kwargs)

    def build(tp_size: int) -> dict:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp_size, create_gloo_process_groups=False)
        torch.manual_seed(0)
        return dict(GPT(cfg).named_parameters())

    torch.Tensor.normal_ = counting
    shard = build(tp)
    torch.Tensor.normal_ = normal
    full = build(1)
    split = {n: p for n, p in shard.items() if getattr(p, "tensor_model_parallel", False)}
    differ = []
    for name, p in split.items():
        chunks = full[name].chunk(tp * p.partition_stride, dim=p.partition_dim)[rank::tp]
        if not torch.equal(p, torch.cat(chunks, dim=p.partition_dim)):
            differ.append(name)
    differ += [n for n, p in shard.items() if n not in split and not torch.equal(p, full[n])]
    local = sum(p.numel() for p in shard.values())
    total = sum(p.numel() for p in full.values())
    info = {"split": len(split), "differ": differ, "drawn": drawn[0], "local": local, "total": total}
    print("FAKE_WORLD", json.dumps(info))


if __name__ == "__main__":
    if sys.argv[1] == "init":
        shard_init(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
