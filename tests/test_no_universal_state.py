"""A checkpoint saved with ``checkpoint.universal=false`` holds only DeepSpeed's layout-bound shards: every
path that needs the layout-independent state (a resume on another layout, ``train.init_from``, export,
``goat-dist eval``) refuses it with an error that names the directory and the setting, before any work."""

from __future__ import annotations

import json

import pytest

from goat_dist.checkpoint import CheckpointError
from goat_dist.checkpoint.manager import CheckpointManager, write_manifest

LAYOUT = {"world": 1, "tp": 1, "dp": 1, "zero_stage": 0, "precision": "fp32", "param_groups": ["decay"]}


@pytest.fixture
def step_dir(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 4, **LAYOUT}))
    (step / "config.yaml").write_text("model:\n  num_layers: 1\n")
    write_manifest(step, {"step": 4})
    (step.parent / "latest").write_text(step.name)
    return step


def test_export_and_eval_refuse(step_dir, tmp_path):
    from goat_dist.checkpoint.export import export
    from goat_dist.evaluation.checkpoint import _read

    with pytest.raises(CheckpointError, match=r"step_00000004: no universal/ state to export \(checkpoint.u"):
        export(step_dir.parent.parent, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=r"no universal/ state to evaluate \(checkpoint.universal"):
        _read(step_dir)


def test_resume_on_another_layout_and_init_from_refuse(step_dir, world1):
    from goat_dist.checkpoint.extension import init_weights

    manager = CheckpointManager(step_dir.parent.parent)
    with pytest.raises(CheckpointError, match=r"saved with layout .* no universal/ state .*its own layout"):
        manager.load(None, step_dir, {**LAYOUT, "tp": 2, "world": 2})
    with pytest.raises(CheckpointError, match=r"no universal/ state .*: train.init_from needs it"):
        init_weights(None, None, step_dir, optimizer=False)
