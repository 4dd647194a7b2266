"""The planner under ``parallel.grad_reduce_dtype`` and ``parallel.grad_accum_dtype``: gradients cross the
data-parallel group in the chosen width (time), and every stage holds the fp32 sums its engine keeps
(memory): ZeRO-2/3 an fp32 partition, ZeRO-0/1 ``BF16_Optimizer``'s whole fp32 buffer."""

from __future__ import annotations

from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.plan.hardware import gpu
from goat_dist.plan.memory import state_bytes, total_params
from goat_dist.plan.planner import layout_of, throughput

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "configs/models/goat_1.3b.yaml"  # bf16, micro 8, global 512


def times(stage: int, key: str, precision: str = "bf16", accum: str = "bf16") -> dict:
    """Throughput of the 1.3B model on 4 nodes x 8 H100 (DP 32 over the network); micro-batches summed in
    ``accum`` (bf16 by default here: the reduction alone changes)."""
    over = [
        f"parallel.zero_stage={stage}",
        f"parallel.grad_reduce_dtype={key}",
        f"train.precision={precision}",
        f"parallel.grad_accum_dtype={accum}",
    ]
    cfg = load_config(MODEL, over)
    return throughput(cfg, layout_of(cfg, 32), gpu("h100-80gb"), 8)


def test_dp_time_doubles_from_bf16_to_fp32_reduction_all_else_fixed():
    """ZeRO-0 moves only gradients: twice the bytes, twice the time. ZeRO-1 all-reduces each bucket whole
    (DeepSpeed's ``average_tensor``) and also all-gathers the updated bf16 weights, which do not change:
    2 x 4 + 2 bytes per element against 2 x 2 + 2 (the volume, ``dp_total_s``; what the boundary
    backward hides is ``test_plan_overlap``'s). ZeRO-2's per-micro-batch reductions hide behind the
    backward as far as it lasts, so its exposed time never shrinks."""
    fp32, bf16 = times(0, "fp32"), times(0, "bf16")
    assert fp32["dp_comm_s"] == pytest.approx(2 * bf16["dp_comm_s"], rel=1e-12) and bf16["dp_comm_s"] > 0
    for key in ("compute_s", "memory_bound_s", "tp_comm_s", "cp_comm_s", "optimizer_s"):
        assert fp32[key] == bf16[key], key
    assert times(1, "fp32")["dp_total_s"] == pytest.approx(10 / 6 * times(1, "bf16")["dp_total_s"])
    # ZeRO-2 reduces every micro-batch behind its backward: never less
    assert times(2, "fp32")["dp_comm_s"] >= times(2, "bf16")["dp_comm_s"] > 0
    assert times(0, "fp32", "fp32")["dp_comm_s"] == times(0, "bf16", "fp32")["dp_comm_s"]  # fp32 runs: fp32
    assert times(0, "fp32", "fp32")["dp_comm_s"] == fp32["dp_comm_s"]


def test_zero1_accumulating_in_fp32_all_reduces_its_sums():
    """ZeRO-1 with fp32 accumulation runs BF16_Optimizer: the fp32 sums are all-reduced and the bf16
    weights all-gathered, the bytes ZeRO-1's bucket all-reduces move too (2 x 4 + 2 per element), but
    all of it after the last backward, where ZeRO-1 hides its reduction behind that backward. ZeRO-0
    all-reduces as before."""
    fp32_sums, bf16_sums = times(1, "fp32", accum="fp32"), times(1, "fp32")
    assert fp32_sums["dp_total_s"] == pytest.approx(bf16_sums["dp_total_s"])
    assert fp32_sums["dp_comm_s"] == fp32_sums["dp_total_s"] > bf16_sums["dp_comm_s"]
    assert times(0, "fp32", accum="fp32")["dp_comm_s"] == times(0, "fp32")["dp_comm_s"]


def state(stage: int, accum: str, global_batch: int = 512) -> dict:
    over = [f"parallel.zero_stage={stage}", f"parallel.grad_accum_dtype={accum}",
            f"train.global_batch_size={global_batch}"]  # fmt: skip
    return state_bytes(load_config(MODEL, over), 8)


def test_fp32_accumulation_holds_fp32_sums_at_every_stage():
    """DP 8, accumulating (512 = micro 8 x DP 8 x 8), fp32 reduction: ZeRO-2's gradients are one fp32 flat
    partition (4 Psi / N) with no second copy, but the whole bf16 gradients of the large parameters
    touching it stay until the backward ends; ZeRO-3's flat partition doubles. ZeRO-0/1 (BF16_Optimizer)
    keep a whole fp32 buffer (4 Psi) next to the bf16 .grad; their masters and moments are as before.
    Without accumulation (global 64) nothing changes."""
    n = total_params(load_config(MODEL).model)
    fp32, bf16 = state(2, "fp32"), state(2, "bf16")
    assert fp32["grads"] == pytest.approx(4 * n / 8, rel=1e-3)
    assert fp32["buffers"] < bf16["buffers"]  # no copy of the partition beside the sum
    assert 0 < fp32["total"] - bf16["total"] < 2 * n / 8  # +0.22 GiB: less than a bf16 partition
    z3, z3_bf16 = state(3, "fp32"), state(3, "bf16")
    assert z3["grads"] == 2 * z3_bf16["grads"]
    for stage in (0, 1):
        sums, plain = state(stage, "fp32"), state(stage, "bf16")
        assert sums["grads"] - plain["grads"] == pytest.approx(4 * n, rel=1e-3), stage
        assert sums["optimizer"] == pytest.approx(plain["optimizer"], rel=1e-3), stage
    for stage in range(4):
        assert state(stage, "fp32", global_batch=64) == state(stage, "bf16", global_batch=64), stage
