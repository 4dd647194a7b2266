"""Memory metrics do not grow with the world: min / mean / max over ranks and the rank of the max, the
same TensorBoard tags and metrics.jsonl keys at a world of 2 and of 64; per-rank detail on request."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch

from goat_dist import collectives
from goat_dist.config import Config
from goat_dist.observe import tags
from goat_dist.observe.step_metrics import GIB, StepMetrics
from goat_dist.trainer.callbacks.loggers import ConsoleLogger, JsonlLogger
from goat_dist.trainer.callbacks.memory import summary


def fake_rows(world: int) -> list[torch.Tensor]:
    """One gathered row per rank: (params sumsq share, allocated, peak, RSS) bytes, rank 37 the largest."""
    rows = []
    for r in range(world):
        peak = (1.0 + r / 100 + (5.0 if r == 37 else 0.0)) * GIB
        rows.append(torch.tensor([0.25, (0.5 + r / 1000) * GIB, peak, 2.0 * GIB + r], dtype=torch.float64))
    return rows


def collect(monkeypatch, world: int, per_rank: bool = False) -> dict:
    monkeypatch.setattr(collectives, "all_gather", lambda t: fake_rows(world))
    cfg = Config()
    cfg.log.memory_per_rank = per_rank
    cpu = torch.device("cpu")
    layout = SimpleNamespace(is_main=False, tp=1, dp=world, dp_rank=0, world=world, device=cpu)
    metrics = StepMetrics(cfg, torch.nn.Linear(3, 2), layout, object())
    state = SimpleNamespace(consumed_tokens=100, consumed_samples=10, stream_start=0)
    return metrics.collect(state, 1.0, 1000.0)


def test_tags_and_keys_per_log_step_do_not_grow_with_the_world(monkeypatch):
    small, large = collect(monkeypatch, 2), collect(monkeypatch, 64)
    assert set(small) == set(large)
    assert len(tags.scalars(small, tags.TRAIN_TAGS)) == len(tags.scalars(large, tags.TRAIN_TAGS))
    assert not any("rank_" in tag for tag, _ in tags.scalars(large, tags.TRAIN_TAGS))
    assert len(json.dumps(large)) == pytest.approx(len(json.dumps(small)), abs=16)  # digits only
    assert large["params_norm"] == pytest.approx((0.25 * 64) ** 0.5)  # still the exact reduction


def test_summaries_are_min_mean_max_and_the_rank_of_the_max(monkeypatch):
    m = collect(monkeypatch, 64)
    peaks = [1.0 + r / 100 + (5.0 if r == 37 else 0.0) for r in range(64)]
    assert m["mem_peak_gib_min"] == pytest.approx(1.0)
    assert m["mem_peak_gib_mean"] == pytest.approx(sum(peaks) / 64, abs=1e-4)
    assert m["mem_peak_gib_max"] == pytest.approx(6.37)
    assert m["mem_peak_gib_max_rank"] == 37
    assert m["mem_allocated_gib_max_rank"] == 63 and m["mem_allocated_gib_min"] == pytest.approx(0.5)
    assert m["host_rss_gib_max_rank"] == 63
    scalars = dict(tags.scalars(m, tags.TRAIN_TAGS))
    assert scalars["mem/peak_gib/max"] == pytest.approx(6.37) and scalars["mem/peak_gib/max_rank"] == 37
    assert {f"mem/{n}/{s}" for n in ("allocated_gib", "peak_gib", "host_rss_gib")
            for s in ("min", "mean", "max", "max_rank")} <= set(scalars)  # fmt: skip


def test_memory_per_rank_brings_back_every_ranks_tags(monkeypatch):
    m = collect(monkeypatch, 64, per_rank=True)
    assert len(m["mem_peak_gib"]) == 64 and m["mem_peak_gib"][37] == pytest.approx(6.37)
    scalars = dict(tags.scalars(m, tags.TRAIN_TAGS))
    assert scalars["mem/rank_37/peak_gib"] == pytest.approx(6.37)
    assert sum(tag.startswith("mem/rank_") for tag in scalars) == 3 * 64
    assert scalars["mem/peak_gib/max_rank"] == 37  # the summaries stay


def test_memory_record_and_console_line_summarise(tmp_path):
    per_rank = {"total": [2**20 * (1 + (r == 5)) for r in range(64)], "params": [10] * 64}
    state = SimpleNamespace(step=2)
    for detail in (False, True):
        record = summary(per_rank, per_rank=detail)
        expected = {"min": 2**20, "mean": 2**20 * 65 / 64, "max": 2**21, "max_rank": 5}
        assert record["bytes"]["total"] == expected
        assert ("bytes_per_rank" in record) == detail
        out = io.StringIO()
        ConsoleLogger(10, stream=out).on_memory(state, record)
        line = out.getvalue()
        assert "min 1.0, mean 1.0, max 2.0 (rank 5)" in line and ("per rank" in line) == detail
        path = tmp_path / f"metrics{detail}.jsonl"
        JsonlLogger(path).on_memory(state, record)
        written = json.loads(path.read_text())
        assert written["event"] == "memory" and written["bytes"]["params"]["max"] == 10
        assert ("bytes_per_rank" in written) == detail
