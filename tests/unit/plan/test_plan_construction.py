"""The planner counts the model's construction peak (``plan.memory.construction_bytes``): ZeRO-3 builds
partitioned (its partitions plus one part whole in fp32), other stages build the whole TP shard in fp32;
a layout whose construction does not fit is "does not fit", the verdict naming the construction peak."""

from __future__ import annotations

import re
from pathlib import Path

from goat_dist.config import load_config
from goat_dist.plan import make_plan, param_inventory
from goat_dist.plan.hardware import GIB, gpu
from goat_dist.plan.memory import construction_bytes, model_parts
from goat_dist.plan.planner import budget, format_plan, largest_micro_batch

ROOT = Path(__file__).resolve().parents[3]
GOAT_30B = ROOT / "configs/models/goat_30b.yaml"
# 30B at TP=1 over 16 nodes x 8 GPUs (DP=128), one sequence per micro-batch, full checkpointing
TP1 = [
    "parallel.tp=1",
    "parallel.sp=false",
    "train.activation_checkpointing=full",
    "train.micro_batch_size=1",
]


def test_the_parts_are_the_models_build_order():
    cfg = load_config(None, ["model.num_layers=3", "model.tie_embeddings=false", "model.position=learned"])
    parts = model_parts(param_inventory(cfg.model, 1))
    assert list(parts) == ["embedding", "pos_embedding", "blocks.0", "blocks.1", "blocks.2", "final_norm",
                           "output"]  # fmt: skip
    assert sum(len(v) for v in parts.values()) == len(param_inventory(cfg.model, 1))


def test_zero3_construction_is_the_partitions_plus_one_layer_whole():
    cfg = load_config(GOAT_30B, [*TP1, "parallel.zero_stage=3"])
    inv = param_inventory(cfg.model, 1)
    n = sum(p.numel for p in inv)
    block = sum(p.numel for p in inv if p.name.startswith("blocks.0."))
    build = construction_bytes(cfg, 128)
    assert build["part"] == "blocks.0" and build["whole_part"] == 4 * block
    assert abs(build["partitions"] - 2 * n / 128) < 1e-3 * build["partitions"]  # bf16 partitions
    assert build["whole_shard"] == 0 and build["total"] < 0.05 * 4 * n  # vs the whole shard in fp32
    # at ZeRO 0-2 every rank builds the whole shard in fp32: 112 GiB for 30B at TP=1
    whole = construction_bytes(load_config(GOAT_30B, [*TP1, "parallel.zero_stage=2"]), 128)
    assert whole["total"] == whole["whole_shard"] == 4 * n


def test_30b_at_tp1_zero3_can_be_built_and_the_plan_says_so_with_the_figure():
    cfg = load_config(GOAT_30B, [*TP1, "parallel.zero_stage=3"])
    plan = make_plan(cfg, 16, 8, gpu("h100-80gb"))
    assert plan["verdict"] == "fits" and plan["verdict_reason"] == ""
    text = format_plan(plan)
    line = next(x for x in text.splitlines() if x.strip().startswith("construction"))
    assert "can be built" in line and "blocks.0 whole in fp32" in line
    figure = float(re.search(r"construction peak ([\d.]+) GiB per GPU", line).group(1))
    assert figure == round(plan["construction"]["total"] / GIB, 2) and figure < 10


def test_a_layout_that_cannot_be_built_does_not_fit_and_names_the_construction_peak():
    """30B at ZeRO-2, TP=1, DP=128: the training state and activations fit in 80 GB, but every rank would
    first build the whole model in fp32 (112 GiB)."""
    cfg = load_config(GOAT_30B, [*TP1, "parallel.zero_stage=2"])
    h100 = gpu("h100-80gb")
    plan = make_plan(cfg, 16, 8, h100)
    assert plan["memory"]["total"] < budget(h100)  # what training holds fits ...
    assert plan["construction"]["total"] > budget(h100)  # ... building does not
    assert plan["verdict"] == "does not fit" and plan["largest_micro_batch"] == 0
    assert largest_micro_batch(cfg, 128, h100) == 0
    assert plan["headroom"] == budget(h100) - plan["construction"]["total"]
    figure = f"{plan['construction']['total'] / GIB:.2f} GiB"
    verdict = next(x for x in format_plan(plan).splitlines() if x.startswith("verdict"))
    assert "does not fit: the model cannot be built: construction peak " + figure in verdict, verdict
    assert "whole TP shard in fp32" in verdict
