"""Start-up: each rank draws only its own TP shard of the initial weights, on its device, and the shards
are the TP=1 weights' slices (TP=2 starts from the TP=1 weights: the layout tests rely on it). Checked
in a fake world of 4 (tests/workers/fake_world.py init), ranks 1 and 3."""

from __future__ import annotations

import json

import pytest
from harness.multiproc import ROOT, marked_line


@pytest.mark.parametrize("rank", [1, 3])
def test_each_rank_draws_its_shard_of_the_tp1_weights(rank):
    worker = str(ROOT / "tests" / "workers" / "fake_world.py")
    info = json.loads(marked_line([worker, "init", "4", str(rank)], "FAKE_WORLD"))
    assert info["split"] >= 20 and info["differ"] == [], info  # every shard is its TP=1 slice
    # a rank draws its shard (plus the edges of blocks its shard cuts), not the whole model
    assert info["drawn"] < 1.5 * info["local"] < 0.5 * info["total"], info
