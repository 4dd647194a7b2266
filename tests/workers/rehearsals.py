"""Rehearse every shipped config at its intended world, and the planted faults, in one process; one JSON
line per case on stdout (``tests/integration/plan/test_rehearsal.py`` reads them).

python tests/workers/rehearsals.py [--layers K] [case ...]   (default: every case)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

# each shipped training config at the world its docs give it: (nodes, GPUs per node)
WORLDS = {
    "configs/tiny.yaml": (1, 1),
    "configs/study/base.yaml": (1, 1),
    "configs/long/cpu_8k.yaml": (1, 2),
    "configs/long/goat_1.3b_32k.yaml": (4, 8),
    "configs/long/goat_1.3b_32k_extend.yaml": (4, 8),
    **{
        f"configs/models/{n}.yaml": (1, 8)
        for n in (
            "goat_125m",
            "goat_350m",
            "goat_760m",
            "goat_1.3b",
            "goat_2.7b",
            "rope_125m",
            "rope_1.3b",
            "alibi_125m",
            "alibi_1.3b",
        )
    },  # fmt: skip
    **{f"configs/models/{n}.yaml": (64, 8) for n in ("goat_6.7b", "goat_13b", "goat_30b")},
    **{str(p.relative_to(ROOT)): (1, 8) for p in sorted((ROOT / "configs/paper").glob("*.yaml"))},
}
NOT_TRAINING = (
    "configs/study/extrapolation.yaml",
    "configs/study/goat_vs_alibi.yaml",
    "configs/study/passkey.yaml",
)


def line() -> int:
    """The caller's line in this file: where a planted fault is expected to be named."""
    return sys._getframe(1).f_lineno


PLANTED: dict[str, int] = {}  # fault -> the line of this file that plants it


@contextlib.contextmanager
def planted(kind: str):
    """Plant one fault into the model's forward (or the loss) for the duration of the block."""
    from goat_dist.model.gpt import GPT

    forward = GPT.forward

    def host_tensor(self, tokens, position_ids, labels=None):
        loss = forward(self, tokens, position_ids, labels)
        PLANTED[kind] = line() + 1
        return loss + torch.ones(1)  # a 1-d host tensor meets the device loss

    def item_in_loss(self, tokens, position_ids, labels=None):
        loss = forward(self, tokens, position_ids, labels)
        PLANTED[kind] = line() + 1
        loss.item()  # a host read of every micro-batch's loss
        return loss

    def host_to_tp(self, tokens, position_ids, labels=None):
        PLANTED[kind] = line() + 1
        dist.all_reduce(torch.zeros(4), group=self.tp_group)  # a host tensor on the NCCL-only TP group
        return forward(self, tokens, position_ids, labels)

    def one_rank_only(self, tokens, position_ids, labels=None):
        if self.layout.rank == 0:
            PLANTED[kind] = line() + 1
            dist.all_reduce(torch.zeros(4, device="meta"), group=self.tp_group)  # only rank 0 makes it
        return forward(self, tokens, position_ids, labels)

    plants = {
        "host tensor in the forward": host_tensor,
        "item in the loss": item_in_loss,
        "host tensor to a TP collective": host_to_tp,
        "collective on one rank": one_rank_only,
    }
    if kind in plants:
        GPT.forward = plants[kind]
    try:
        yield
    finally:
        GPT.forward = forward


# planted faults: (config, nodes, GPUs per node, overrides)
PLANTS = {
    "host tensor in the forward": ("configs/models/goat_125m.yaml", 1, 8, ["parallel.tp=2"]),
    "item in the loss": ("configs/models/goat_125m.yaml", 1, 8, []),
    "host tensor to a TP collective": ("configs/models/goat_125m.yaml", 1, 8, ["parallel.tp=2"]),
    "collective on one rank": ("configs/models/goat_125m.yaml", 1, 8, ["parallel.tp=2"]),
    "fp32 into FA4": (
        "configs/models/goat_125m.yaml",
        1,
        8,
        ["train.precision=fp32", "model.attention_backend=flash4"],
    ),  # fmt: skip
}


# variants of shipped configs whose step must be as clean: (config, nodes, GPUs per node, overrides)
VARIANTS = {
    # learned positions checked their range with a host read per micro-batch (fixed)
    "learned positions": ("configs/models/goat_125m.yaml", 1, 8, ["model.position=learned"]),
    # packed documents without context parallelism: one host read of the positions per micro-batch
    "documents, TP2 SP": (
        "configs/models/goat_125m.yaml",
        1,
        8,
        ["data.document_masking=true", "parallel.tp=2", "parallel.sp=true"],
    ),  # fmt: skip
    # the FA2 stand-in of an A100, packed documents through its varlen kernel
    "A100, documents": ("configs/models/goat_125m.yaml", 1, 8, ["data.document_masking=true"]),
    "ZeRO-3, full checkpointing": (
        "configs/models/goat_1.3b.yaml",
        1,
        8,
        ["parallel.zero_stage=3", "train.activation_checkpointing=full"],
    ),  # fmt: skip
}
GPU_OF = {"A100, documents": "a100-80gb"}


def result(name: str, r, planted_line: int | None = None) -> dict:
    from goat_dist.rehearsal.run import format_rehearsal

    return {
        "case": name,
        "world": r.world,
        "rank": r.run.rank,
        "backend": r.run.backend,
        "grad_accum": r.run.grad_accum,
        "clean": r.clean,
        "faults": [{"kind": f.kind, "where": f.where, "what": f.what} for f in r.faults],
        "syncs": dict(r.run.syncs),
        "syncs_per_step": r.syncs_per_step,
        "documented_syncs": r.documented_syncs,
        "volumes": r.volumes,
        "memory": r.memory,
        "seconds": r.seconds,
        "last_line": r.last_line(),
        "report": format_rehearsal(r),
        "planted_line": planted_line,
    }


def main() -> None:
    from goat_dist.config import load_config
    from goat_dist.plan.hardware import gpu
    from goat_dist.rehearsal import rehearse

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("cases", nargs="*")
    args = p.parse_args()
    h100 = gpu("h100-80gb")
    cases = args.cases or [*WORLDS, *VARIANTS, *PLANTS]
    for case in cases:
        if case in VARIANTS:
            path, nodes, per_node, overrides = VARIANTS[case]
            cfg = load_config(ROOT / path, overrides)
            device = gpu(GPU_OF.get(case, "h100-80gb"))
            r = rehearse(
                cfg, nodes * per_node, device, layers=args.layers, name=case, memory=not args.no_memory
            )
            print(json.dumps(result(case, r)), flush=True)
            continue
        if case in PLANTS:
            path, nodes, per_node, overrides = PLANTS[case]
            cfg = load_config(ROOT / path, overrides)
            with planted(case):
                r = rehearse(cfg, nodes * per_node, h100, layers=args.layers, name=case, memory=False)
            print(json.dumps(result(case, r, PLANTED.get(case))), flush=True)
            continue
        nodes, per_node = WORLDS[case]
        cfg = load_config(ROOT / case, [])
        r = rehearse(cfg, nodes * per_node, h100, layers=args.layers, name=case, memory=not args.no_memory)
        print(json.dumps(result(case, r)), flush=True)


if __name__ == "__main__":
    main()
