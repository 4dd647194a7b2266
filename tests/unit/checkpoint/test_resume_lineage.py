"""Checkpoint lineage: ``keep_last`` counts only the current run's checkpoints; newer leftovers of an
abandoned line (a rollback, ``train.resume=never`` in an old run dir) are moved to ``checkpoints/stale/``.
One process, a tiny real engine, the real CheckpointManager."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.lineage import PARENT, lineage
from goat_dist.checkpoint.names import STALE, STATE


@pytest.fixture(scope="module")
def engine(world1):
    from goat_dist.config import load_config
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize

    cfg = load_config(
        None,
        [
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.num_heads=2",
            "model.seq_len=16",
            "model.vocab_size=128",
            "model.attention_backend=sdpa",
            "train.micro_batch_size=1",
            "train.global_batch_size=1",
        ],
    )
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    engine.goat_cfg = cfg
    return engine


def save(manager: CheckpointManager, engine, step: int):
    state = {"step": step, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    return manager.save(engine, state, yaml.safe_dump(engine.goat_cfg.to_dict()))


def steps_in(root) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


def test_rollback_keeps_the_new_runs_last_checkpoints(engine, tmp_path, capsys):
    first = CheckpointManager(tmp_path, keep_last=3)
    first.begin(None, 0)
    for step in (8, 10, 12):
        save(first, engine, step)
    root = first.root
    assert steps_in(root) == [8, 10, 12]

    # roll back to step 8 and train two steps with keep_last=2: checkpoints 9 and 10 of the new line
    second = CheckpointManager(tmp_path, keep_last=2)
    moved = second.begin(root / "step_00000008", 8)
    assert moved == ["step_00000010", "step_00000012"]
    assert "moved to" in capsys.readouterr().out
    assert (root / "latest").read_text() == "step_00000008"  # repointed: it named a moved checkpoint
    save(second, engine, 9)
    save(second, engine, 10)
    assert steps_in(root) == [9, 10]  # step 8 pruned as the new line's third-newest; stale 12 not counted
    assert (root / "latest").read_text() == "step_00000010"
    assert sorted(p.name for p in (root / STALE).iterdir()) == ["step_00000010", "step_00000012"]
    assert lineage(root, "step_00000010") == ["step_00000010", "step_00000009"]
    assert json.loads((root / "step_00000009" / STATE).read_text())[PARENT] == "step_00000008"


def test_resume_never_in_an_old_run_dir_moves_everything_aside(engine, tmp_path):
    old = CheckpointManager(tmp_path, keep_last=0)
    old.begin(None, 0)
    for step in (2, 4):
        save(old, engine, step)
    fresh = CheckpointManager(tmp_path, keep_last=1)
    assert fresh.begin(None, 0) == ["step_00000002", "step_00000004"]
    assert not (fresh.root / "latest").exists()  # a crash before the first save must not resume the old run
    save(fresh, engine, 2)
    save(fresh, engine, 3)
    assert steps_in(fresh.root) == [3]
    assert sorted(p.name for p in (fresh.root / STALE).iterdir()) == ["step_00000002", "step_00000004"]


def test_checkpoints_without_recorded_parents_prune_by_step(engine, tmp_path):
    """Checkpoints written before lineages were recorded: the next older complete one is the parent."""
    manager = CheckpointManager(tmp_path, keep_last=0)
    manager.begin(None, 0)
    for step in (1, 2, 3):
        save(manager, engine, step)
    for step_dir in manager.root.glob("step_*"):
        state = json.loads((step_dir / STATE).read_text())
        del state[PARENT]
        (step_dir / STATE).write_text(json.dumps(state))
    resumed = CheckpointManager(tmp_path, keep_last=2)
    assert resumed.begin(manager.root / "step_00000003", 3) == []
    save(resumed, engine, 4)
    assert steps_in(manager.root) == [3, 4]
