"""A full disk during a checkpoint save (ENOSPC from any of its writes, synchronous or in the background)
is one CheckpointError (exit 2) naming the directory and the bytes needed and free; the unfinished save is
removed and the previous checkpoint stays ``latest`` and intact. In-process, the writes monkeypatched."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config

from goat_dist.checkpoint import CheckpointError, CheckpointManager, manager, tensor_file
from goat_dist.checkpoint.digests import read_manifest, verify
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize
from goat_dist.trainer.entry import exit_code_for, user_error_message


def full(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def setup(world1, tmp_path):
    """(manager, engine, config text) with step 1 published."""
    cfg = one_layer_config()
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    text = yaml.safe_dump(cfg.to_dict())
    checkpoints = CheckpointManager(tmp_path / "run")
    checkpoints.save(engine, state(1), text)
    return checkpoints, engine, text


def state(step: int) -> dict:
    return {"step": step, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}


def fail_on(monkeypatch, name: str) -> None:
    """ENOSPC from the write of checkpoint file ``name``."""
    if name == "universal":
        monkeypatch.setattr(tensor_file, "_write", full)
    elif name == "rng":
        monkeypatch.setattr(torch, "save", full)
    elif name == "manifest":
        monkeypatch.setattr(manager, "write_manifest", full)
    else:  # trainer_state.json, config.yaml or latest, written atomically
        real = manager.atomic_write_text

        def write(path, text):
            (full if Path(path).name == name else real)(path, text)

        monkeypatch.setattr(manager, "atomic_write_text", write)


def assert_previous_survives(checkpoints, root: Path, message: str) -> None:
    assert (root / "latest").read_text() == "step_00000001"
    assert not (root / "step_00000002").exists()  # the unfinished save, removed
    verify(root / "step_00000001")
    assert "step_00000001 stays `latest`" in message and "bytes are free" in message
    assert "No space left on device" in message


@pytest.mark.parametrize(
    "name, where",
    [
        ("universal", "step_00000002/universal"),
        ("rng", "step_00000002"),
        ("trainer_state.json", "step_00000002"),
        ("manifest", "step_00000002"),
        ("latest", "checkpoints"),
    ],
)
def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays(setup, monkeypatch, name, where):
    checkpoints, engine, text = setup
    root = checkpoints.root
    with monkeypatch.context() as patch:
        fail_on(patch, name)
        with pytest.raises(CheckpointError) as caught:
            checkpoints.save(engine, state(2), text)
    message = str(caught.value)
    directory = root if where == "checkpoints" else root / where
    assert f"The disk holding {directory} is full" in message, message
    size = read_manifest(root / "step_00000001")["files"]
    assert f"the last checkpoint took {sum(f['bytes'] for f in size.values()):,} bytes" in message
    assert_previous_survives(checkpoints, root, message)
    assert exit_code_for(caught.value) == 2 and "\n" not in user_error_message(caught.value)
    assert checkpoints.save(engine, state(2), text).name == "step_00000002"  # space freed: it saves


def test_the_file_being_written_says_how_many_bytes_it_needs(setup, monkeypatch):
    checkpoints, engine, text = setup
    expected = (checkpoints.root / "step_00000001" / "universal" / "rank00000.safetensors").stat().st_size
    fresh = CheckpointManager(checkpoints.root.parent)  # a new process: the last size from save_cost.json
    monkeypatch.setattr(tensor_file, "_write", full)
    with pytest.raises(CheckpointError) as caught:
        fresh.save(engine, state(2), text)
    message = str(caught.value)
    assert f"universal/rank00000.safetensors needs {expected:,} bytes" in message, message
    assert "the last checkpoint took" in message
    assert_previous_survives(fresh, checkpoints.root, message)


def test_a_full_disk_during_an_asynchronous_save(setup, monkeypatch):
    checkpoints, engine, text = setup
    monkeypatch.setattr(tensor_file, "_write", full)
    checkpoints.save_async(engine, state(2), text)
    with pytest.raises(CheckpointError) as caught:
        checkpoints.wait()
    message = str(caught.value)
    assert "universal/rank00000.safetensors needs" in message and "is full" in message
    assert_previous_survives(checkpoints, checkpoints.root, message)
    assert checkpoints.pending is None
