"""A checkpoint that no rank sees does not exist: the error says so and lists the checkpoints that do exist
in its directory; the advice to share run.dir between nodes only when another rank sees it
(``checkpoint/resume.py``). One process (``world1``); the other ranks' answers are patched in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from goat_dist.checkpoint import CheckpointError, CheckpointManager, resume
from goat_dist.checkpoint.names import LATEST, MANIFEST, STALE, STATE

SHARED_FS = "shared by all nodes"


def fake_checkpoint(root: Path, step: int) -> Path:
    """A step directory as ``what_is_missing`` and the listing see a complete one."""
    step_dir = root / f"step_{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / MANIFEST).write_text(json.dumps({"files": {}, "step": step}))
    (step_dir / STATE).write_text(json.dumps({"step": step}))
    return step_dir


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """checkpoints/ with steps 6 and 8 (latest), step 2 long pruned, step 10 moved aside."""
    root = tmp_path / "run" / "checkpoints"
    for step in (6, 8):
        fake_checkpoint(root, step)
    fake_checkpoint(root / STALE, 10)
    (root / LATEST).write_text("step_00000008")
    return tmp_path / "run"


def refused(choice: str, run_dir: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(run_dir).choose_resume(choice)
    return str(e.value)


def test_a_pruned_step_does_not_exist_and_the_others_are_listed(world1, run_dir):
    wanted = run_dir / "checkpoints" / "step_00000002"
    message = refused(str(wanted), run_dir)
    assert f"checkpoint {wanted}, which train.resume={wanted} names, does not exist" in message
    assert "step_00000006, step_00000008 (latest)" in message
    assert "older ones are pruned: checkpoint.keep_last" in message
    assert f"moved aside in {run_dir / 'checkpoints' / STALE}: step_00000010" in message
    assert message.endswith("Set train.resume to one of them")
    assert SHARED_FS not in message and "\n" not in message


def test_a_typo_in_a_relative_path_names_the_directory_it_was_resolved_from(world1, run_dir, monkeypatch):
    monkeypatch.chdir(run_dir.parent)
    message = refused("run/checkpoints/step_0000008", run_dir)  # one digit short
    assert "run/checkpoints/step_0000008 names, does not exist" in message
    assert f"(resolved from {run_dir.parent})" in message
    assert "step_00000006, step_00000008 (latest)" in message and "pruned" not in message
    assert SHARED_FS not in message

    message = refused("ruin/checkpoints/step_00000008", run_dir)
    assert message.endswith("ruin/checkpoints does not exist either") and SHARED_FS not in message


def test_latest_naming_a_missing_checkpoint_and_a_run_dir_named_instead_of_a_step(world1, run_dir):
    (run_dir / "checkpoints" / LATEST).write_text("step_00000012")
    message = refused("auto", run_dir)
    assert "which rank 0's checkpoints/latest names, does not exist" in message
    assert "step_00000006, step_00000008;" in message and SHARED_FS not in message

    message = refused(str(run_dir), run_dir)
    assert "is a run directory, not a checkpoint (train.resume takes a checkpoint's step" in message
    assert f"the checkpoints in {run_dir / 'checkpoints'}: step_00000006" in message


def test_an_interrupted_save_is_not_a_complete_checkpoint(world1, run_dir):
    partial = run_dir / "checkpoints" / "step_00000009"
    partial.mkdir()
    (partial / STATE).write_text("{}")
    message = refused(str(partial), run_dir)
    assert f"{partial}, which train.resume={partial} names, is not a complete checkpoint" in message
    assert f"it has no {MANIFEST}" in message and SHARED_FS not in message


def test_the_shared_filesystem_advice_when_another_rank_sees_it(world1, run_dir, monkeypatch):
    """Rank 0 (this process) does not see the checkpoint, rank 1 does: the file systems differ."""
    monkeypatch.setattr(resume.collectives, "all_gather", lambda t: [t, torch.tensor([0])])
    wanted = run_dir / "checkpoints" / "step_00000002"
    message = refused(str(wanted), run_dir)
    assert f"rank 0 cannot see checkpoint {wanted}" in message and SHARED_FS in message
    assert "names, does not exist" not in message and "the checkpoints in" not in message
