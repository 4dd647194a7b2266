"""Checkpoint formats: a format-0 checkpoint (DeepSpeed's own shards only, ``checkpoint.universal=false`` in
earlier releases) is refused by every path (resume on any layout, ``train.init_from``, export, ``goat-dist
eval``) with an error naming the directory, the format and what to do, before any work; a universal state
of an unknown (newer) format is refused naming its version; ``checkpoint.universal=false`` is refused as a
setting. Format 1 (one file per TP rank) is read by the same reader: ``test_resume_slices.py`` writes it."""

from __future__ import annotations

import json

import pytest

from goat_dist.checkpoint import CheckpointError
from goat_dist.checkpoint.manager import CheckpointManager, write_manifest
from goat_dist.config import ConfigError, load_config

LAYOUT = {"world": 1, "tp": 1, "dp": 1, "zero_stage": 0, "precision": "fp32", "param_groups": ["decay"]}
FORMAT0 = r"step_00000004 has no universal/ state: it is a format-0 checkpoint .*cannot {}.*release that"


@pytest.fixture
def step_dir(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 4, **LAYOUT}))
    (step / "config.yaml").write_text("model:\n  num_layers: 1\n")
    (step / "mp_rank_00_model_states.pt").write_bytes(b"DeepSpeed's shard")
    write_manifest(step, {"step": 4})
    (step.parent / "latest").write_text(step.name)
    return step


def test_export_and_eval_refuse_format_0(step_dir, tmp_path):
    from goat_dist.checkpoint.export import export, inspect
    from goat_dist.evaluation.checkpoint import _read

    assert inspect(step_dir)["format"] == 0

    with pytest.raises(CheckpointError, match=FORMAT0.format("export it")):
        export(step_dir.parent.parent, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=FORMAT0.format("evaluate it")):
        _read(step_dir)


def test_resume_on_any_layout_and_init_from_refuse_format_0(step_dir, world1):
    from goat_dist.checkpoint.extension import init_weights

    manager = CheckpointManager(step_dir.parent.parent)
    for layout in (LAYOUT, {**LAYOUT, "tp": 2, "world": 2}):
        with pytest.raises(CheckpointError, match=FORMAT0.format("resume from it")):
            manager.load(None, step_dir, layout)
    with pytest.raises(CheckpointError, match=FORMAT0.format("start train.init_from from it")):
        init_weights(None, None, step_dir, optimizer=False)


def test_a_newer_format_is_refused_naming_its_version(tmp_path):
    from goat_dist.checkpoint.slices import UniversalReader

    (tmp_path / "universal").mkdir()
    (tmp_path / "universal" / "meta.json").write_text(json.dumps({"format": 4, "tp": 1}))
    with pytest.raises(CheckpointError, match=r"meta.json is format 4; this goat-dist reads formats 1 to 3"):
        UniversalReader(tmp_path, 1, 0)


def test_universal_false_is_refused_as_a_setting():
    with pytest.raises(ConfigError, match=r"checkpoint.universal=false is no longer an option"):
        load_config(None, ["checkpoint.universal=false"])
    assert load_config(None, ["checkpoint.universal=true"]).checkpoint.universal
