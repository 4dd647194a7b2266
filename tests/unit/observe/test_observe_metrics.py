"""Log-step metrics: the parameter norm is exact under TP / DP / ZeRO-3 sharding; tags expand lists."""

from __future__ import annotations

import math

import pytest
import torch

from goat_dist.observe import tags
from goat_dist.observe.step_metrics import StepMetrics, param_sumsq_share


def shard(
    full: dict[str, torch.Tensor], split: set[str], tp: int, tp_rank: int, dp: int, dp_rank: int, zero3
):
    """One rank's view of the parameters under TP (split names along dim 0) and DP (ZeRO-3: flat partitions
    padded to equal size)."""
    module = torch.nn.Module()
    for name, value in full.items():
        local = value.chunk(tp)[tp_rank] if name in split else value
        p = torch.nn.Parameter(local.clone())
        if name in split:
            p.tensor_model_parallel = True
        if zero3:
            flat = local.flatten()
            size = math.ceil(flat.numel() / dp)
            padded = torch.cat([flat, torch.full((size * dp - flat.numel(),), 7.0)])  # junk in the padding
            p.ds_tensor = padded[dp_rank * size : (dp_rank + 1) * size]
            p.ds_numel = flat.numel()
            p.data = torch.empty(0)
        module.register_parameter(name, p)
    return module


@pytest.mark.parametrize(
    "tp,dp,zero3", [(1, 1, False), (2, 1, False), (1, 3, False), (2, 2, False), (2, 3, True)]
)
def test_params_norm_shares_sum_to_the_global_norm(tp, dp, zero3):
    torch.manual_seed(0)
    full = {"w": torch.randn(6, 5), "norm": torch.randn(5), "odd": torch.randn(7)}
    split = {"w"}
    total = sum(
        param_sumsq_share(shard(full, split, tp, t, dp, d, zero3), tp, dp, d)
        for t in range(tp)
        for d in range(dp)
    )
    expected = sum(float(v.double().pow(2).sum()) for v in full.values())
    assert total == pytest.approx(expected, rel=1e-6)  # fp32 sums of squares (step_metrics.sumsq)


def test_params_norm_copies_one_fp32_piece_at_a_time_and_stays_within_1e6_of_fp64(monkeypatch):
    """``sumsq`` of a bf16 tensor larger than ``NORM_CHUNK``: no operation makes a tensor of more than a
    piece (the fp64 cast it replaced made two of the whole tensor), and the sum is within 1e-6 of the fp64
    one, on a tensor of 10k elements as on one of 3 pieces of the real 4M (rounding grows with the
    pieces' length: measured 5e-9 at 128M elements in 4M pieces)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from goat_dist.observe import step_metrics

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.most = max(self.most, t.numel())  # a new tensor (views share their input's storage)
            return out

    gen = torch.Generator().manual_seed(0)
    chunk = 1 << 22  # the real NORM_CHUNK (checked last)
    for n, piece in ((10_007, 1000), (3 * chunk + 5, chunk)):
        monkeypatch.setattr(step_metrics, "NORM_CHUNK", piece, raising=False)
        values = (torch.randn(n, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(values, requires_grad=False)
        with Largest() as seen:
            got = param_sumsq_share(module, 1, 1, 0)
        assert seen.most <= piece, f"a tensor of {seen.most} elements for a piece of {piece}"
        expected = float(values.double().pow(2).sum())
        assert got == pytest.approx(expected, rel=1e-6)
    monkeypatch.undo()
    assert step_metrics.NORM_CHUNK == chunk


def test_list_metrics_expand_to_one_tag_per_element():
    metrics = {
        "loss": 2.5,
        "mem_peak_gib": [1.0, 2.0],
        "attn_entropy": [0.1],
        "data_fingerprint": 7,
        "flag": True,
    }
    assert tags.scalars(metrics, tags.TRAIN_TAGS) == [
        ("loss/train", 2.5),
        ("mem/rank_0/peak_gib", 1.0),
        ("mem/rank_1/peak_gib", 2.0),
    ]
    assert tags.scalars(metrics, tags.EVAL_TAGS) == [("val/attn/layer_0/entropy", 0.1)]
    assert math.isnan(tags.scalars({"loss": float("nan")}, tags.TRAIN_TAGS)[0][1])


def test_epoch_counts_passes_over_the_most_repeated_source():
    class Source:
        def __init__(self, weight):
            self.weight = weight

    class Dataset:
        sources = [Source(3.0), Source(1.0)]
        windows_per_epoch = [600, 100]

    from types import SimpleNamespace

    from goat_dist.config import Config

    layout = SimpleNamespace(is_main=False)
    m = StepMetrics(Config(), None, layout, Dataset())
    assert m.epoch(800) == pytest.approx(2.0)  # source 1 gets a quarter: 200 samples of its 100 windows
    Dataset.windows_per_epoch = None  # a generated source: no epochs
    assert StepMetrics(Config(), None, layout, Dataset()).epoch(800) == 0.0


def test_losses_sort_before_every_other_tag():
    """TensorBoard sorts card groups and cards by tag name: the losses open the dashboard."""
    every = [
        tag.format(i=0)
        for table in (tags.TRAIN_TAGS, tags.EVAL_TAGS, tags.PRIOR_TAGS)
        for tag in table.values()
    ]
    assert sorted(every)[:2] == ["loss/train", "loss/val"]
    assert {tag.split("/")[0] for tag in every} == {"loss", "mem", "perf", "train", "val"}
