"""The planner counts ZeRO-2's gradient reduce-scatter once per micro-batch (what the micro-batch's
backward does not hide) and the params-norm log step's float64 transient."""

from __future__ import annotations

from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.plan import make_plan, param_inventory
from goat_dist.plan.hardware import gpu
from goat_dist.plan.memory import transient_bytes
from goat_dist.plan.planner import format_plan, layout_of, throughput

GOAT_30B = Path(__file__).resolve().parents[3] / "configs/models/goat_30b.yaml"


# the 30B config's layout before it took plan --search's (TP 8 + SP, micro 4): accumulating at DP 16
TP8 = ["parallel.tp=8", "parallel.sp=true", "train.micro_batch_size=4", "train.activation_checkpointing=none"]


def dp_seconds(stage: int, global_batch: int) -> tuple[float, float]:
    over = [*TP8, f"parallel.zero_stage={stage}", f"train.global_batch_size={global_batch}"]
    cfg = load_config(GOAT_30B, over)
    layout = layout_of(cfg, 128)
    return layout["grad_accum"], throughput(cfg, layout, gpu("h100-80gb"), 8)["dp_comm_s"]


def test_zero2_dp_time_grows_with_accumulation_zero1_does_not():
    (a8, z1_8), (a16, z1_16) = dp_seconds(1, 512), dp_seconds(1, 1024)
    (_, z2_8), (_, z2_16) = dp_seconds(2, 512), dp_seconds(2, 1024)
    assert (a8, a16) == (8, 16)
    assert z1_16 == pytest.approx(z1_8)  # once per step
    assert z2_16 > 1.5 * z2_8  # every micro-batch: the exposed part doubles, the weight gather does not
    assert z2_8 > z1_8  # 30B at accumulation 8: ZeRO-2 no longer ties ZeRO-1


def test_params_norm_fp32_piece_is_in_the_breakdown():
    from goat_dist.observe import step_metrics
    from goat_dist.plan import memory

    assert memory.NORM_CHUNK == step_metrics.NORM_CHUNK  # the piece the norm squares at once
    for stage in (1, 3):
        cfg = load_config(GOAT_30B, ["parallel.tp=1", "parallel.sp=false", f"parallel.zero_stage={stage}"])
        largest = max(p.numel for p in param_inventory(cfg.model, 1))
        t = transient_bytes(cfg, 128, 1)
        # one fp32 piece of the largest tensor this rank holds, at most NORM_CHUNK elements
        local = largest if stage == 1 else -(-largest // 128)
        assert t["params_norm"] == 4 * min(memory.NORM_CHUNK, local)
        assert t["total"] == sum(v for k, v in t.items() if k != "total")
    plan = make_plan(load_config(GOAT_30B, []), 16, 8, gpu("h100-80gb"))
    assert plan["memory"]["transient"]["params_norm"] > 0
    assert "params_norm" in format_plan(plan)
