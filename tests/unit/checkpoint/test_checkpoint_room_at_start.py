"""Room for checkpoints, checked at the start of training (``CheckpointManager.check_room``, called by the
checkpointing callback): a disk without room for one checkpoint stops the run before its first step (exit
2, naming run.dir, the bytes needed and free); one without room for what ``checkpoint.keep_last`` keeps is
a warning. In-process; the bytes free are patched."""

from __future__ import annotations

import pytest
from harness.multiproc import in_process_config

from goat_dist.checkpoint import CheckpointError, space
from goat_dist.doctor.size import DISK_HEADROOM, checkpoint_bytes, next_checkpoint_bytes
from goat_dist.trainer.entry import exit_code_for, user_error_message


@pytest.mark.parametrize(
    "keep_last, kept, saves, more",
    [
        (2, 0, 10, 3),  # two kept, and the third written before the first is pruned
        (2, 2, 10, 1),  # a resume with its two on disk: one more at a time
        (2, 5, 10, 1),  # keep_last lowered: the extra ones go after the first save
        (2, 0, 1, 1),  # a short run saves once
        (3, 1, 2, 2),
        (0, 4, 6, 6),  # keep_last=0 keeps every save
        (0, 0, None, None),  # ... and time-based saves have no bound
        (2, 0, None, 3),
        (2, 1, 0, 0),  # a run that saves nothing (a stop still saves one)
    ],
)
def test_checkpoints_to_come(keep_last, kept, saves, more):
    assert space.checkpoints_to_come(keep_last, kept, saves) == more


def test_room_at_start_error_and_warning(tmp_path, monkeypatch):
    need = 10_000_000
    root = tmp_path / "run" / "checkpoints"  # not there yet: its nearest parent is measured
    monkeypatch.setattr(space, "free_bytes", lambda path: need - 1)
    error, warning = space.room_at_start(tmp_path / "run", root, need, 2, 0, 5)
    assert error.startswith(f"run.dir={tmp_path / 'run'}: no room for one checkpoint")
    assert "needs ~10,000,000 bytes (10.0 MB) and 9,999,999 bytes (10.0 MB) are free" in error
    assert warning == "" and "\n" not in error

    monkeypatch.setattr(space, "free_bytes", lambda path: 2 * need)
    error, warning = space.room_at_start(tmp_path / "run", root, need, 2, 0, 5)
    assert error == ""
    assert warning.startswith(f"warning: run.dir={tmp_path / 'run'}: room for 2 checkpoint(s)")
    assert "needs room for 3 more (checkpoint.keep_last=2 keeps 2" in warning
    assert space.room_at_start(tmp_path / "run", root, need, 2, 2, 5) == ("", "")  # a resume: 1 more
    assert space.room_at_start(tmp_path / "run", root, need, 0, 0, None) == ("", "")  # no bound: no warning


def trainer(cache, run_dir, *overrides):
    from goat_dist.trainer import Trainer

    return Trainer(in_process_config(cache, run_dir, "train.max_steps=3", *overrides), callbacks=[])


def test_a_disk_without_room_for_one_checkpoint_stops_before_the_first_step(
    world1, builtin_cache, tmp_path, monkeypatch
):
    run = trainer(builtin_cache, tmp_path / "run")
    need = next_checkpoint_bytes(run.cfg)
    assert need == int(checkpoint_bytes(run.cfg) * DISK_HEADROOM) > 0  # the doctor's estimate
    monkeypatch.setattr(space, "free_bytes", lambda path: need // 2)
    with pytest.raises(CheckpointError) as e:
        run.fit()
    assert run.state.step == 0  # nothing was trained
    message = str(e.value)
    assert f"run.dir={tmp_path / 'run'}: no room for one checkpoint" in message
    assert f"needs ~{need:,} bytes" in message and f"{need // 2:,} bytes" in message
    assert exit_code_for(e.value) == 2 and "\n" not in user_error_message(e.value)


def test_no_room_for_what_keep_last_keeps_is_a_warning(world1, builtin_cache, tmp_path, monkeypatch, capsys):
    run = trainer(builtin_cache, tmp_path / "run", "checkpoint.interval=1", "checkpoint.keep_last=2")
    need = next_checkpoint_bytes(run.cfg)
    monkeypatch.setattr(space, "free_bytes", lambda path: 2 * need)  # 3 saves, 3 at once: 2 fit
    run.fit()
    out = capsys.readouterr().out
    assert out.count("warning: run.dir=") == 1 and "needs room for 3 more" in out
    assert run.state.step == 3

    again = trainer(builtin_cache, tmp_path / "run", "train.max_steps=4", "checkpoint.keep_last=2")
    again.fit()  # two on disk, the end's save writes one more before pruning: it fits
    assert "warning: run.dir=" not in capsys.readouterr().out and again.state.step == 4
