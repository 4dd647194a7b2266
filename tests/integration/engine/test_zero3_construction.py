"""ZeRO-3 builds the model partitioned (``engine/construct.py``): on a real 2-rank gloo world, the model the
trainer builds under ZeRO-3 holds the same initial weights (gathered) as the one built whole without ZeRO,
a rank's construction allocates about its share (its partitions plus one part's whole tensors, not the
whole model), and the engine takes the partitions as they are: the same optimizer groups and the same
losses as an engine that partitioned a whole-built model itself. Nothing is broadcast at start (neither
``zero.Init`` as it partitions nor the engine given a whole model: ``patches.checked_not_broadcast``):
the ranks' weights are identical because they built them so, as their fingerprints' all-reduce checked.
Slow (one launch, ~1 min on 2 cores)."""

from __future__ import annotations

import pytest
from harness.distributed import run_distributed

pytestmark = pytest.mark.slow

OVERRIDES = [
    "model.num_layers=8",
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.vocab_size=512",
    "model.tie_embeddings=false",
    "model.attention_backend=sdpa",
    "train.precision=fp32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "parallel.zero_stage=3",
]


def _peak_tracker():
    """(reset, peak): RSS high-water mark above the RSS at ``reset``, in bytes. Every allocation above
    64 KiB is its own mapping (a fixed mmap threshold), so a freed tensor leaves the RSS at once and the
    high-water mark follows the live tensors; tracemalloc would see none of torch's allocations."""
    import ctypes
    import gc
    import re
    from pathlib import Path

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD

    def kib(field: str) -> int:
        return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))

    state = {}

    def reset() -> None:
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        state["base"] = kib("VmRSS") * 1024

    def peak() -> int:
        return kib("VmHWM") * 1024 - state["base"]

    return reset, peak


def _two_steps(engine, vocab: int) -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, 33), generator=gen)
        loss = engine(tokens[:, :-1], torch.arange(32).expand(2, -1), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _built_partitioned_rank(layout) -> dict:
    import torch
    import torch.distributed as dist

    from goat_dist.config import load_config
    from goat_dist.engine.construct import partition_as_built
    from goat_dist.engine.patches import fingerprint
    from goat_dist.engine.zero3 import gathered, is_partitioned
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize
    from goat_dist.plan.memory import construction_bytes

    broadcast, broadcasts = dist.broadcast, []

    def counted(tensor, *args, **kwargs):  # DeepSpeed's comm layer calls torch.distributed.broadcast
        broadcasts.append(tensor.numel() * tensor.element_size())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counted
    cfg = load_config(None, OVERRIDES)
    reset, peak = _peak_tracker()
    # a first small build loads the code both builds run (library pages count in the RSS too); seeded
    # as every build is (the trainer's seed_everything): the ranks' weights are checked, not broadcast
    torch.manual_seed(0)
    GPT(load_config(None, [*OVERRIDES, "model.num_layers=1"]).model, built=partition_as_built(cfg, 1, layout))
    hook = partition_as_built(cfg, grad_accum=1, layout=layout)
    reset()
    torch.manual_seed(0)
    model = GPT(cfg.model, built=hook)
    built_bytes = peak()
    reset()
    torch.manual_seed(0)
    whole = GPT(cfg.model)
    whole_bytes = peak()
    with gathered(model):
        differ = [n for n, p in model.named_parameters() if not torch.equal(p, whole.get_parameter(n))]
        weights = [fingerprint(p).tolist() for p in model.parameters()]
    result = {
        "partitioned": all(is_partitioned(p) for p in model.parameters()),
        "differ": differ,
        "names": len(list(model.parameters())),
        "built_bytes": built_bytes,
        "whole_bytes": whole_bytes,
        "model_bytes": sum(4 * p.numel() for p in whole.parameters()),
        "part_bytes": hook.largest_part_bytes,
        "parts": hook.parts,
        "planned": construction_bytes(cfg, layout.dp),
        "planned_whole": construction_bytes(load_config(None, [*OVERRIDES, "parallel.zero_stage=0"]), 2),
    }
    for key, m in (("built", model), ("whole", whole)):
        engine = parallelize(m, cfg, 1)
        names = {id(p): n for n, p in m.named_parameters()}
        opt = engine.deepspeed.optimizer  # ZeRO-3's
        groups = zip(opt.optimizer.param_groups, opt.fp16_groups)
        result[f"{key}_groups"] = {g["name"]: sorted(names[id(p)] for p in ps) for g, ps in groups}
        result[f"{key}_losses"] = _two_steps(engine, cfg.model.vocab_size)
    dist.broadcast = broadcast
    return {**result, "weights": weights, "broadcasts": broadcasts}


def test_zero3_builds_partitioned_with_the_whole_models_weights():
    ranks = run_distributed(_built_partitioned_rank, world=2, timeout_s=400)
    for r in ranks:
        assert r["partitioned"] and r["differ"] == [] and r["names"] > 20, r
        assert r["parts"] == 8 + 3  # embedding, 8 blocks, final norm, output
        share = r["model_bytes"] / 2
        # its partitions (half the model) plus one part whole, with a little slack for what the build
        # allocates besides tensors; the whole build holds the whole model
        assert 0.9 * share < r["built_bytes"] < share + r["part_bytes"] + 0.05 * r["model_bytes"], r
        assert r["whole_bytes"] > 0.95 * r["model_bytes"], r
        assert r["built_bytes"] < 0.7 * r["whole_bytes"], r
        # the planner's figures (plan.memory.construction_bytes) are what the builds hold at their peak
        planned = r["planned"]
        assert planned["whole_part"] == r["part_bytes"] and planned["part"] == "blocks.0", planned
        assert abs(r["built_bytes"] / planned["total"] - 1) < 0.1, (r["built_bytes"], planned)
        assert abs(r["whole_bytes"] / r["planned_whole"]["total"] - 1) < 0.05, r
        # the engine takes the partitions as they are: the same groups (weight decay by the full
        # shapes, not the placeholders'), the same losses as when DeepSpeed partitions a whole model
        assert r["built_groups"] == r["whole_groups"] and len(r["built_groups"]["decay"]) > 8, r
        assert r["built_losses"] == r["whole_losses"], r
    assert ranks[0]["built_losses"] == ranks[1]["built_losses"]
    # identical weights on both ranks, none of them broadcast (DeepSpeed broadcast every parameter: in
    # zero.Init for the partitioned build, in the engine and in zero.Init for the whole one); what is left
    # is a few pickled objects (broadcast_object_list: 11 KB in all)
    assert ranks[0]["weights"] == ranks[1]["weights"] and len(ranks[0]["weights"]) == ranks[0]["names"]
    for r in ranks:
        assert sum(r["broadcasts"]) < 1e-3 * r["model_bytes"], (sum(r["broadcasts"]), r["model_bytes"])
