"""`goat-dist study --force` deletes only the run dirs the study created (``study_run.json``) and none a
trainer holds; a directory the study did not create is never deleted, trained into or reused; the
record is written atomically at the start of a run. Trainings are faked by a tiny child process."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from goat_dist.evaluation.study import StudyError, load_study
from goat_dist.evaluation.study import runs as study_runs
from goat_dist.evaluation.study.spec import RECORD
from goat_dist.run_lock import RunLock

# A stand-in for `goat-dist train`: it needs the study's record in its run dir (written before it
# starts), then leaves what a finished run leaves (last_exit.json and a checkpoint).
FAKE_TRAIN = """
import json, sys
from pathlib import Path
where = Path(sys.argv[1])
record = json.loads((where / "study_run.json").read_text())
if record["status"] != "training":
    sys.exit(3)
(where / "checkpoints").mkdir(exist_ok=True)
(where / "checkpoints" / "latest").write_text("step_1")
(where / "last_exit.json").write_text(json.dumps({"status": "finished"}))
(where / "trained").write_text("fake")
"""


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A one-run, one-seed study writing to ``tmp_path/runs``, whose training is FAKE_TRAIN."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"runs": {"baseline": []}, "seeds": [1], "out": str(tmp_path / "runs")}))

    def fake_command(st, name, seed=None):
        return [sys.executable, "-c", FAKE_TRAIN, str(study_runs.run_dir(st, name, seed))]

    monkeypatch.setattr(study_runs, "train_command", fake_command)
    return load_study(path)


def finish_like_a_study(study: dict, where) -> None:
    """The state a study leaves after training a run (marker, end record, checkpoint)."""
    study_runs.write_record(study, "baseline", 1, "finished")
    (where / "checkpoints").mkdir()
    (where / "checkpoints" / "latest").write_text("step_9")
    (where / "last_exit.json").write_text(json.dumps({"status": "finished"}))
    (where / "old_step").write_text("the old training")


def test_force_leaves_a_directory_the_study_did_not_create(study):
    where = study_runs.run_dir(study, "baseline", 1)
    where.mkdir(parents=True)
    notes = where / "my_notes.md"
    notes.write_text("mine")
    with pytest.raises(StudyError, match="did not create") as err:
        study_runs.train_all(study, force=True)
    assert str(where) in str(err.value) and RECORD in str(err.value)
    assert notes.read_text() == "mine" and sorted(p.name for p in where.iterdir()) == ["my_notes.md"]
    # the study's out: with the user's own run above the seed dirs: that one is not touched either
    seedless = {**study, "seeds": [None]}
    with pytest.raises(StudyError, match="did not create"):
        study_runs.train_all(seedless, force=True)
    assert notes.read_text() == "mine"


def test_without_force_a_foreign_directory_is_neither_trained_into_nor_reused(study):
    where = study_runs.run_dir(study, "baseline", 1)
    where.mkdir(parents=True)
    (where / "my_notes.md").write_text("mine")
    with pytest.raises(StudyError, match="did not create"):
        study_runs.train_all(study, force=False)
    assert not (where / RECORD).exists() and not (where / "trained").exists()
    # a finished run the study has no record of is not reused unchecked
    (where / "checkpoints").mkdir()
    (where / "checkpoints" / "latest").write_text("step_9")
    (where / "last_exit.json").write_text(json.dumps({"status": "finished"}))
    with pytest.raises(StudyError, match="did not create"):
        study_runs.pending_runs(study, False, {"baseline": {}}, {"baseline": {}})


def test_a_torn_record_is_not_reused_but_force_retrains_it(study):
    where = study_runs.run_dir(study, "baseline", 1)
    where.mkdir(parents=True)
    finish_like_a_study(study, where)
    (where / RECORD).write_text('{"train_config": "No')  # torn by a crash of an older study
    with pytest.raises(StudyError, match="unreadable") as err:
        study_runs.pending_runs(study, False, {"baseline": {}}, {"baseline": {}})
    assert str(where / RECORD) in str(err.value)
    trained = study_runs.train_all(study, force=True)
    assert trained["seconds"]["baseline"]["1"] > 0 and (where / "trained").exists()


def test_force_retrains_the_studys_own_runs(study):
    where = study_runs.run_dir(study, "baseline", 1)
    where.mkdir(parents=True)
    finish_like_a_study(study, where)
    again = study_runs.train_all(study, force=False)  # the same settings: reused
    assert again["seconds"]["baseline"]["1"] == 0.0 and not (where / "trained").exists()
    trained = study_runs.train_all(study, force=True)
    assert trained["seconds"]["baseline"]["1"] > 0  # trained again (FAKE_TRAIN exits 3 without a record)
    assert (where / "trained").exists() and not (where / "old_step").exists()
    record = json.loads((where / RECORD).read_text())
    assert record["status"] == "finished" and record["overrides"] == ["train.seed=1"]
    assert sorted(p.name for p in where.parent.iterdir()) == ["seed1"]  # nothing left aside


def test_force_retrains_a_half_finished_run(study):
    where = study_runs.run_dir(study, "baseline", 1)
    study_runs.write_record(study, "baseline", 1, "training")  # killed mid-training
    (where / "old_step").write_text("the old training")
    study_runs.train_all(study, force=True)
    assert (where / "trained").exists() and not (where / "old_step").exists()


def test_force_never_deletes_a_run_a_trainer_holds(study):
    where = study_runs.run_dir(study, "baseline", 1)
    where.mkdir(parents=True)
    finish_like_a_study(study, where)
    lock = RunLock(where).acquire()  # a live trainer (this process) holds the run dir
    try:
        with pytest.raises(StudyError, match="in use by another trainer") as err:
            study_runs.train_all(study, force=True)
        assert str(where) in str(err.value)
        assert (where / "old_step").exists() and (where / RECORD).exists()
    finally:
        lock.release()
    assert sorted(p.name for p in where.parent.iterdir()) == ["seed1"]


def test_force_deletes_nothing_through_a_symbolic_link(study, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / RECORD).write_text("{}")
    (elsewhere / "data").write_text("keep")
    where = study_runs.run_dir(study, "baseline", 1)
    where.parent.mkdir(parents=True)
    where.symlink_to(elsewhere)
    with pytest.raises(StudyError, match="symbolic link"):
        study_runs.pending_runs(study, True, {"baseline": {}}, {"baseline": {}})
    assert (elsewhere / "data").read_text() == "keep"


def test_the_record_is_written_atomically(study, monkeypatch):
    where = study_runs.run_dir(study, "baseline", 1)
    study_runs.write_record(study, "baseline", 1, "finished")
    before = (where / RECORD).read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("goat_dist.atomic.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        study_runs.write_record(study, "baseline", 1, "training")
    assert (where / RECORD).read_text() == before  # the old record, whole
    assert sorted(p.name for p in where.iterdir()) == [RECORD]  # no temp file left
