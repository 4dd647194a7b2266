"""``goat-dist plan --materialize``: the real model and optimizer of each rank of a 16-rank world, built on
the meta device under a fake process group, against the planner's per-rank numbers, printed as one row per
distinct shard with the number of ranks holding it."""

from __future__ import annotations

import re

import pytest
from harness.multiproc import ROOT, run

from goat_dist.config import load_config
from goat_dist.plan.dry_run import _spans, distinct_rows
from goat_dist.plan.memory import _flat_partition, param_inventory
from goat_dist.plan.planner import memory_at

CONFIG = ROOT / "configs" / "models" / "goat_125m.yaml"
OVERRIDES = ["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1", "train.global_batch_size=256"]
ROW = re.compile(r"^tp (\S+) x dp (\S+)\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


@pytest.mark.slow
def test_dry_run_prints_one_row_per_distinct_shard():
    import sys

    cmd = [sys.executable, "-m", "goat_dist", "plan", "--config", str(CONFIG), "--nodes", "2",
           "--gpus-per-node", "8", "--materialize", *OVERRIDES]  # fmt: skip
    out = run(cmd, timeout=300).stdout
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    # ZeRO-1: every rank of a TP rank holds the same sizes, and both TP ranks hold the same shapes
    assert rows == [rows[0]] and rows[0][:3] == ("0-1", "0-7", "16"), out
    cfg = load_config(CONFIG, OVERRIDES)
    inv = param_inventory(cfg.model, tp=2)
    per_rank = sum(p.numel for p in inv)
    groups: dict[str, int] = {}
    for p in inv:
        groups[p.group] = groups.get(p.group, 0) + p.numel
    owned = sum(_flat_partition(n, 8) for n in groups.values())  # ZeRO-1 over DP=8
    mem = memory_at(cfg, 8, cfg.train.micro_batch_size)
    row = rows[0]
    assert int(row[3].replace(",", "")) == per_rank  # as built (the command checks names and shapes)
    assert int(row[4].replace(",", "")) == owned
    assert float(row[5]) == pytest.approx(mem["state"]["total"] / 2**30, abs=1e-3)
    assert per_rank < sum(p.numel for p in param_inventory(cfg.model, tp=1))  # TP did split the weights
    assert "fits" in out and "8 TP ranks" not in out and "2 TP ranks built" in out


def test_ranks_with_different_figures_get_rows_of_their_own():
    """ZeRO-2's ranks hold slightly different gradient partitions: one row per distinct figure set,
    naming its TP and DP ranks and counting them."""
    figures = {"params": 10, "zero_owned": 5, "activation_bytes": 7}
    ranks = []
    for r in range(8):
        odd = int(r // 2 == 3)  # DP rank 3's partition differs
        ranks.append({"rank": r, "tp_rank": r % 2, "dp_rank": r // 2, **figures,
                      "state_bytes": 100 + odd, "total_bytes": 200 + odd})  # fmt: skip
    rows = distinct_rows(ranks)
    assert [(r["ranks"], r["count"], r["state_bytes"]) for r in rows] == [
        ("tp 0-1 x dp 0-2", 6, 100),
        ("tp 0-1 x dp 3", 2, 101),
    ]
    assert _spans([7, 1, 2, 3, 5, 8]) == "1-3,5,7-8"
