"""What the planner takes DeepSpeed to overlap, stage by stage (``plan.planner.dp_schedule``): ZeRO-0 and
``BF16_Optimizer`` reduce after the last backward (exposed); ZeRO-1's hooks all-reduce buckets during the
boundary micro-batch's backward, ZeRO-2's during every backward; ZeRO-3 prefetches its gathers. What
hides is never below the last bucket (or ZeRO-3's first layer), and nothing hides without streams."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.engine import sizes
from goat_dist.plan import param_inventory
from goat_dist.plan.hardware import gpu
from goat_dist.plan.planner import _ring, dp_schedule, layout_of, throughput

MODEL = Path(__file__).resolve().parents[3] / "configs/models/goat_1.3b.yaml"  # bf16, micro 8
H100 = gpu("h100-80gb")
WORLD = 32  # 4 nodes x 8: DP over the network


def run(stage: int, global_batch: int = 512, device=H100, **extra) -> dict:
    over = [f"parallel.zero_stage={stage}", f"train.global_batch_size={global_batch}"]
    over += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    cfg = load_config(MODEL, over)
    return throughput(cfg, layout_of(cfg, WORLD), device, 8)


def numel() -> int:
    return sum(p.numel for p in param_inventory(load_config(MODEL).model, 1))


def network() -> float:
    return H100.network_gb_s * 1e9 * H100.link_efficiency


def test_zero0_and_bf16_optimizer_reduce_after_the_backward():
    """ZeRO-0, and ZeRO-1 accumulating in fp32 (BF16_Optimizer), hide nothing: exposed = total."""
    for stage in (0, 1):
        th = run(stage)  # 512 = 8 x 32 x 2: two micro-batches, fp32 sums
        assert th["dp_comm_s"] == th["dp_total_s"] > 0 and th["dp_hidden_s"] == 0, stage
        assert "boundary" in th["dp_schedule"]


def test_zero1_reduces_during_the_boundary_backward_only():
    """ZeRO-1 without BF16_Optimizer (one micro-batch, or bf16 sums): each bucket is all-reduced whole
    (``average_tensor``'s multi-rank bucket all-reduce), hidden behind the boundary micro-batch's backward
    but its last bucket; the weights' all-gather does not hide; more micro-batches do not widen the
    window (only the last backward reduces)."""
    g = numel()
    bucket = _ring(4 * sizes.bucket_elements(2048), WORLD, network(), all_reduce=True)
    reduce_s = _ring(4 * g, WORLD, network(), all_reduce=True)
    gather_s = _ring(2 * g, WORLD, network(), all_reduce=False)
    one = run(1, global_batch=256)  # micro 8 x DP 32: one micro-batch a step
    assert one["dp_total_s"] == pytest.approx(reduce_s + gather_s)
    assert one["dp_comm_s"] == pytest.approx(max(bucket, reduce_s - one["backward_s"]) + gather_s)
    assert gather_s < one["dp_comm_s"] < one["dp_total_s"]
    two = run(1, parallel__grad_accum_dtype="bf16")  # two micro-batches summed in bf16: ZeRO-1's optimizer
    assert two["dp_total_s"] == pytest.approx(reduce_s + gather_s)  # reduced once, at the boundary
    assert two["dp_comm_s"] == pytest.approx(max(bucket, reduce_s - two["backward_s"] / 2) + gather_s)
    # BF16_Optimizer (fp32 sums) moves the same bytes, all after the backward
    sums = run(1)
    assert sums["dp_total_s"] == pytest.approx(two["dp_total_s"]) and sums["dp_comm_s"] > two["dp_comm_s"]


def test_zero2_hides_each_reduction_behind_its_backward_but_its_last_bucket():
    th = run(2)
    g = numel()
    bucket = _ring(4 * sizes.bucket_elements(2048), WORLD, network(), all_reduce=True)
    gather_s = _ring(2 * g, WORLD, network(), all_reduce=False)
    reduce_s = _ring(4 * g, WORLD, network(), all_reduce=True)
    assert th["dp_total_s"] == pytest.approx(2 * reduce_s + gather_s)
    per_micro = max(bucket, reduce_s - th["backward_s"] / 2)
    assert th["dp_comm_s"] == pytest.approx(2 * per_micro + gather_s)
    assert th["dp_comm_s"] < th["dp_total_s"]


def test_zero3_prefetches_gathers_in_forward_and_backward():
    th = run(3)
    assert 0 < th["dp_comm_s"] < th["dp_total_s"]
    assert "prefetched" in th["dp_schedule"]
    # exposed: at least the first layer's gather in each pass of each micro-batch
    inv = param_inventory(load_config(MODEL).model, 1)
    threshold = sizes.persistence_threshold(2048)
    layer = sum(p.numel for p in inv if p.name.startswith("blocks.0.") and p.numel > threshold)
    assert th["dp_comm_s"] >= 2 * 2 * _ring(2 * layer, WORLD, network(), all_reduce=False)


def test_without_streams_nothing_hides():
    """DeepSpeed's CPU accelerator has no reduction stream: every stage's exposed time is its total."""
    host = dataclasses.replace(H100, streams=False)
    for stage in range(4):
        th = run(stage, device=host)
        assert th["dp_comm_s"] == pytest.approx(th["dp_total_s"]) and th["dp_total_s"] > 0, stage


def test_a_measured_host_counts_each_collective_and_its_kind():
    """``measured_host``: no streams, the measured bus bandwidth as it is, a fixed cost per collective
    (ZeRO-1: one per bucket all-reduced and one per optimizer group gathered) and gloo's measured
    all-gather / reduce-scatter time over a ring's."""
    from goat_dist.plan.hardware import measured_host

    plain = measured_host(1e11, 1.0, 20.0)
    slow = measured_host(1e11, 1.0, 20.0, latency_s=1e-3, reduce_scatter_cost=2.0)
    a, b = run(1, global_batch=256, device=plain), run(1, global_batch=256, device=slow)
    buckets = -(-numel() // sizes.bucket_elements(2048))
    assert b["dp_total_s"] - a["dp_total_s"] == pytest.approx((buckets + 3) * 1e-3)
    assert a["dp_comm_s"] == a["dp_total_s"] and "nothing hides" in a["dp_schedule"]
    z3 = run(3, device=plain), run(3, device=measured_host(1e11, 1.0, 20.0, reduce_scatter_cost=2.0))
    reduce_s = _ring(4 * numel(), WORLD, 1e9, all_reduce=False)
    assert z3[1]["dp_total_s"] - z3[0]["dp_total_s"] == pytest.approx(2 * reduce_s)  # 2 micro-batches


def test_fp32_wire_moves_twice_the_gradient_bytes():
    """The reduce dtype sets the gradient bytes in every stage's volume; weights stay bf16."""
    g = numel()
    gather_s = _ring(2 * g, WORLD, network(), all_reduce=False)
    for stage in (1, 2):
        fp32 = run(stage, parallel__grad_reduce_dtype="fp32", parallel__grad_accum_dtype="bf16")
        bf16 = run(stage, parallel__grad_reduce_dtype="bf16", parallel__grad_accum_dtype="bf16")
        assert fp32["dp_total_s"] - gather_s == pytest.approx(2 * (bf16["dp_total_s"] - gather_s)), stage


def test_dp_schedule_is_what_throughput_counts():
    cfg = load_config(MODEL, ["parallel.zero_stage=2"])
    lay = layout_of(cfg, WORLD)
    th = throughput(cfg, lay, H100, 8)
    s = dp_schedule(cfg, lay, H100, 8, th["forward_s"], th["backward_s"])
    assert s["exposed_s"] == th["dp_comm_s"] and s["total_s"] == th["dp_total_s"]
    assert s["bucket_elements"] == sizes.bucket_elements(2048) and s["grad_bytes"] == 4
    parts = ("compute_s", "memory_bound_s", "tp_comm_s", "cp_comm_s", "dp_comm_s", "optimizer_s")
    assert th["step_s"] == pytest.approx(sum(th[k] for k in parts))
