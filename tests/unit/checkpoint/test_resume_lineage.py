"""Checkpoint lineage: ``keep_last`` counts only the current run's checkpoints; newer leftovers of an
abandoned line (a rollback, ``train.resume=never`` in an old run dir) are moved to ``checkpoints/stale/``.
One process, a tiny real engine, the real CheckpointManager."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.lineage import ORIGIN, PARENT, lineage, recorded_origin
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


def start(manager: CheckpointManager, resume: str):
    """What the trainer does at start: rank 0's choice, then the lineage begun at it (nothing loaded)."""
    chosen = manager.choose_resume(resume)
    step = int(chosen.name.split("_")[1]) if chosen else 0
    moved = manager.begin(chosen, step, recorded_origin(chosen) if chosen else None)
    return chosen, moved


def test_a_pinned_fork_requeued_continues_from_its_own_newest(engine, tmp_path, capsys):
    """``run.dir=new train.resume=old/step_6``, killed after saving 10, run again with the same command
    (a Slurm requeue): it continues from new's step 10, not from old's 6, and moves nothing aside."""
    old = CheckpointManager(tmp_path / "old", keep_last=0)
    old.begin(None, 0)
    for step in (4, 6):
        save(old, engine, step)
    pin = str(old.root / "step_00000006")

    first = CheckpointManager(tmp_path / "new", keep_last=3)
    assert start(first, pin) == (old.root / "step_00000006", [])
    for step in (8, 10):
        save(first, engine, step)
    assert recorded_origin(first.root / "step_00000010") == str(old.root.resolve() / "step_00000006")

    again = CheckpointManager(tmp_path / "new", keep_last=3)
    assert start(again, pin) == (again.root / "step_00000010", [])
    assert "continuing from the newest" in capsys.readouterr().out
    spelled = str(tmp_path / "old" / ".." / "old" / "checkpoints" / "step_00000006")  # the same pin
    assert start(CheckpointManager(tmp_path / "new", keep_last=3), spelled)[0] == again.root / "step_00000010"
    save(again, engine, 12)  # the origin is inherited: the next requeue continues too
    assert start(CheckpointManager(tmp_path / "new"), pin)[0] == again.root / "step_00000012"
    assert not (again.root / STALE).exists() and steps_in(again.root) == [8, 10, 12]
    assert steps_in(old.root) == [4, 6]

    # another pin is a new start: the run's own newer checkpoints leave its lineage, as a rollback's do
    chosen, moved = start(CheckpointManager(tmp_path / "new"), str(old.root / "step_00000004"))
    assert chosen == old.root / "step_00000004" and moved == [
        "step_00000008",
        "step_00000010",
        "step_00000012",
    ]


def test_a_pinned_rollback_requeued_continues_from_the_new_line(engine, tmp_path):
    """``train.resume=<own older step>`` rolls back once; the same command again continues the new line."""
    run = CheckpointManager(tmp_path, keep_last=0)
    run.begin(None, 0)
    for step in (8, 10, 12):
        save(run, engine, step)
    pin = str(run.root / "step_00000008")
    rollback = CheckpointManager(tmp_path, keep_last=0)
    assert start(rollback, pin) == (run.root / "step_00000008", ["step_00000010", "step_00000012"])
    save(rollback, engine, 9)
    requeued = CheckpointManager(tmp_path, keep_last=0)
    assert start(requeued, pin) == (run.root / "step_00000009", [])
    assert sorted(p.name for p in (run.root / STALE).iterdir()) == ["step_00000010", "step_00000012"]


def test_a_pin_without_a_recorded_origin_starts_at_the_pin(engine, tmp_path):
    """Checkpoints saved before origins were recorded: the pin wins, as it always did."""
    old = CheckpointManager(tmp_path / "old", keep_last=0)
    old.begin(None, 0)
    save(old, engine, 2)
    pin = str(old.root / "step_00000002")
    new = CheckpointManager(tmp_path / "new", keep_last=0)
    start(new, pin)
    save(new, engine, 3)
    state = json.loads((new.root / "step_00000003" / STATE).read_text())
    del state[ORIGIN]
    (new.root / "step_00000003" / STATE).write_text(json.dumps(state))
    assert start(CheckpointManager(tmp_path / "new"), pin)[0] == old.root / "step_00000002"
