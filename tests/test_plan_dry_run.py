"""``goat-dist plan --materialize``: the real model and optimizer of each rank of a 16-rank world, built on
the meta device under a fake process group, against the planner's per-rank numbers."""

from __future__ import annotations

import re

import pytest
from multiproc import ROOT, run

from goat_dist.config import load_config
from goat_dist.plan.memory import _flat_partition, param_inventory
from goat_dist.plan.planner import memory_at

CONFIG = ROOT / "configs" / "models" / "goat_125m.yaml"
OVERRIDES = ["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1", "train.global_batch_size=256"]


@pytest.mark.slow
def test_dry_run_prints_the_planners_shards_for_every_rank():
    import sys

    cmd = [sys.executable, "-m", "goat_dist", "plan", "--config", str(CONFIG), "--nodes", "2",
           "--gpus-per-node", "8", "--materialize", *OVERRIDES]  # fmt: skip
    out = run(cmd, timeout=300).stdout
    rows = [r.split() for r in out.splitlines() if re.match(r"^\s*\d+\s+\d+\s+\d+\s+[\d,]+\s+[\d,]+\s", r)]
    assert len(rows) == 16, out
    cfg = load_config(CONFIG, OVERRIDES)
    inv = param_inventory(cfg.model, tp=2)
    per_rank = sum(p.numel for p in inv)
    groups: dict[str, int] = {}
    for p in inv:
        groups[p.group] = groups.get(p.group, 0) + p.numel
    owned = sum(_flat_partition(n, 8) for n in groups.values())  # ZeRO-1 over DP=8
    mem = memory_at(cfg, 8, cfg.train.micro_batch_size)
    for rank, row in enumerate(rows):
        assert [int(x) for x in row[:3]] == [rank, rank % 2, rank // 2]  # megatron: TP groups are consecutive
        assert int(row[3].replace(",", "")) == per_rank  # as built (the command checks names and shapes)
        assert int(row[4].replace(",", "")) == owned
        assert float(row[5]) == pytest.approx(mem["state"]["total"] / 2**30, abs=1e-3)
    assert per_rank < sum(p.numel for p in param_inventory(cfg.model, tp=1))  # TP did split the weights
    assert "fits" in out and "8 TP ranks" not in out and "2 TP ranks built" in out
