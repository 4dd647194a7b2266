"""The ``run_distributed`` harness itself: results come back in rank order from a real gloo world with the
asked layout, a raising rank fails the call with its traceback, and a hang ends at the timeout."""

from __future__ import annotations

import time

import pytest
from harness.distributed import DistributedFailure, run_distributed


def _reduce_and_describe(layout, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value + layout.rank)])
    dist.all_reduce(t)
    return {"rank": layout.rank, "tp_rank": layout.tp_rank, "dp": layout.dp, "sum": t.item()}


def _raise_on_rank_one(layout):
    if layout.rank == 1:
        raise ValueError("rank one refuses")
    return layout.rank


def _hang_on_rank_one(layout):
    if layout.rank == 1:
        time.sleep(600)
    return layout.rank


@pytest.mark.slow
def test_results_come_back_in_rank_order_with_the_layout():
    out = run_distributed(_reduce_and_describe, world=2, tp=2, args=(10,))
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["tp_rank"] for o in out] == [0, 1]
    assert all(o["dp"] == 1 and o["sum"] == 21.0 for o in out)  # (10 + 0) + (10 + 1): a real all-reduce


@pytest.mark.slow
def test_a_raising_rank_fails_with_its_traceback():
    with pytest.raises(DistributedFailure, match="(?s)rank 1 of 2 raised.*ValueError: rank one refuses"):
        run_distributed(_raise_on_rank_one, world=2)


@pytest.mark.slow
def test_a_hang_ends_at_the_timeout():
    # rank 0 returns at once; rank 1 sleeps for 10 minutes and is killed 5 s after both ranks initialised
    with pytest.raises(DistributedFailure, match=r"ranks \[1\] of 2 returned nothing within 5 s"):
        run_distributed(_hang_on_rank_one, world=2, timeout_s=5)
