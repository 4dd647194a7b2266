"""Evaluating another checkpoint into the same directory keeps the earlier report (eval passkey, eval
harness): it is renamed to ``<stem>.step<N>``, its picture alike, and the command says so; the same
checkpoint measured again replaces its own report."""

from __future__ import annotations

import json

from goat_dist.evaluation.harness import write_harness
from goat_dist.evaluation.reports import write_passkey


def passkey(step: int, checkpoint: str = "runs/a/checkpoints/x") -> dict:
    return {
        "checkpoint": checkpoint,
        "step": step,
        "position": "goat",
        "samples_per_cell": 2,
        "lengths": [64, 128],
        "depths": [0.0, 1.0],
        "accuracy": [[1.0, 0.5], [0.5, 0.0]],
        "digit_accuracy": [[1.0, 0.8], [0.6, 0.1]],
        "train_seq_len": 64,
    }


def test_passkey_of_another_step_keeps_the_earlier_report_and_picture(tmp_path):
    first = write_passkey(passkey(100), tmp_path)
    assert first[2] is None  # nothing there before
    again = write_passkey(passkey(100), tmp_path)
    assert again[2] is None and sorted(p.name for p in tmp_path.iterdir()) == ["passkey.json", "passkey.png"]
    png_100 = (tmp_path / "passkey.png").read_bytes()
    json_path, png_path, note = write_passkey(passkey(200), tmp_path)
    assert json.loads(json_path.read_text())["step"] == 200
    assert json.loads((tmp_path / "passkey.step100.json").read_text())["step"] == 100
    assert (tmp_path / "passkey.step100.png").read_bytes() == png_100
    assert note == f"kept the earlier report (step 100) as {tmp_path / 'passkey.step100.json'}"
    # step 100 of another run's checkpoint: step100 is taken, so it gets its own name, nothing replaced
    write_passkey(passkey(100, "runs/b/checkpoints/x"), tmp_path)
    note = write_passkey(passkey(300), tmp_path)[2]
    assert note is not None and "passkey.step100-2.json" in note
    kept = json.loads((tmp_path / "passkey.step100-2.json").read_text())
    assert kept["checkpoint"] == "runs/b/checkpoints/x"
    assert json.loads((tmp_path / "passkey.step100.json").read_text())["checkpoint"] == "runs/a/checkpoints/x"


def test_harness_of_another_checkpoint_keeps_the_earlier_report(tmp_path):
    path, note = write_harness({"checkpoint": "a", "step": 5, "results": {"x": 1}}, tmp_path)
    assert note is None
    path, note = write_harness({"checkpoint": "a", "step": 9, "results": {"x": 2}}, tmp_path)
    assert json.loads(path.read_text())["results"] == {"x": 2}
    assert json.loads((tmp_path / "harness.step5.json").read_text())["results"] == {"x": 1}
    assert note is not None and "harness.step5.json" in note
