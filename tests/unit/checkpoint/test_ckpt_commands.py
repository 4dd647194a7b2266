"""``goat-dist ckpt export`` never destroys what it did not write (a non-empty OUT is refused, ``--force``
replaces only a previous export's own files and keeps the user's beside them), in both formats;
``goat-dist ckpt verify`` says OK or names the corrupt file. In-process, through the command line's
``main``."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config

from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.export import MARKER
from goat_dist.cli import main
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize

FORMATS = ("goat", "hf")


@pytest.fixture(scope="module")
def run_dir(world1, tmp_path_factory):
    """A run directory as training leaves it: a checkpoint, metrics, TensorBoard events, the config."""
    run = tmp_path_factory.mktemp("ckpt-commands") / "run"
    cfg = one_layer_config()
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    state = {"step": 1, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(run).save(engine, state, yaml.safe_dump(cfg.to_dict()))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    return run


def snapshot(root) -> dict:
    """Every entry under ``root``: file -> sha256 of its bytes, directory -> None."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def ckpt(capsys, *argv) -> tuple[int, str, str]:
    code = main(["ckpt", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def export(capsys, run_dir, out, fmt, *extra):
    return ckpt(capsys, "export", run_dir, out, "--format", fmt, *extra)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_export_into_a_directory_with_a_user_file_leaves_it(run_dir, tmp_path, capsys, fmt, force):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    code, _, err = export(capsys, run_dir, out, fmt, *(["--force"] if force else []))
    assert code == 2
    assert str(out) in err and "notes.txt" in err and "not empty" in err and err.count("\n") == 1
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"my notes").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp dir left beside it


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_export_into_the_run_directory_leaves_the_run_intact(run_dir, capsys, fmt, force):
    before = snapshot(run_dir.parent)
    code, _, err = export(capsys, run_dir, run_dir, fmt, *(["--force"] if force else []))
    assert code == 2 and str(run_dir) in err and "checkpoints" in err
    assert snapshot(run_dir.parent) == before


def test_export_into_the_working_directory_leaves_its_files(run_dir, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('mine')\n")
    monkeypatch.chdir(work)
    code, _, err = export(capsys, run_dir, ".", "goat", "--force")
    assert code == 2 and str(work) in err and "train.py" in err
    mine = hashlib.sha256(b"print('mine')\n").hexdigest()
    assert snapshot(tmp_path) == {"work": None, "work/train.py": mine}


@pytest.mark.parametrize("fmt", FORMATS)
def test_force_replaces_a_previous_export_and_only_with_force(run_dir, tmp_path, capsys, fmt):
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, fmt)[0] == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["format"] == fmt and marker["step"] == 1 and "model.safetensors" in marker["files"]
    assert sorted(marker["files"]) == sorted(p.name for p in out.iterdir() if p.name != MARKER)
    first = snapshot(out)

    code, _, err = export(capsys, run_dir, out, fmt, "--dtype", "bf16")
    assert code == 2 and str(out) in err and "--force" in err
    assert snapshot(out) == first

    code, out_text, _ = export(capsys, run_dir, out, fmt, "--dtype", "bf16", "--force")
    assert code == 0 and "exported" in out_text
    assert json.loads((out / MARKER).read_text())["dtype"] == "bf16"
    assert snapshot(out)["model.safetensors"] != first["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # the replaced export is gone


@pytest.mark.parametrize("fmt", FORMATS)
def test_force_replaces_the_exports_files_and_keeps_the_users(run_dir, tmp_path, capsys, fmt):
    """The Hugging Face habit: a model card (the export's own README.md, edited), notes and eval results
    added to an export. --force replaces what the export wrote and keeps those, byte for byte."""
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, fmt)[0] == 0
    (out / "README.md").write_text("# my model\nhow I trained it\n")
    (out / "notes.txt").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "ppl.json").write_text("{}")
    mine = {
        k: v for k, v in snapshot(out).items() if k in ("README.md", "notes.txt", "eval", "eval/ppl.json")
    }
    first = snapshot(out)["model.safetensors"]

    code, _, err = export(capsys, run_dir, out, fmt, "--dtype", "bf16")  # without --force: refused
    assert code == 2 and "--force" in err and "README.md" in err and err.count("\n") == 1
    code, text, err = export(capsys, run_dir, out, fmt, "--dtype", "bf16", "--force")
    assert code == 0 and "exported" in text, err
    now = snapshot(out)
    assert {k: now.get(k) for k in mine} == mine  # the user's files, unchanged
    assert now["model.safetensors"] != first  # the export's own, replaced
    marker = json.loads((out / MARKER).read_text())
    assert marker["dtype"] == "bf16" and not {"README.md", "notes.txt", "eval"} & set(marker["files"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # nothing left beside it
    # again: the user's card stays the user's (not in the marker, so never replaced)
    assert export(capsys, run_dir, out, fmt, "--force")[0] == 0
    assert (out / "README.md").read_text() == "# my model\nhow I trained it\n"


def test_force_never_removes_what_a_tampered_marker_names_outside_the_export(run_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, "goat")[0] == 0
    outside = tmp_path / "precious.txt"
    outside.write_text("the user's")
    marker = json.loads((out / MARKER).read_text())
    marker["files"] += ["../precious.txt", str(outside)]
    (out / MARKER).write_text(json.dumps(marker))
    assert export(capsys, run_dir, out, "goat", "--force")[0] == 0
    assert outside.read_text() == "the user's"


def test_an_unedited_model_card_is_the_exports_and_is_replaced(run_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, "goat")[0] == 0
    assert "README.md" in json.loads((out / MARKER).read_text())["files"]
    assert "goat-dist format, fp32 weights" in (out / "README.md").read_text()
    assert export(capsys, run_dir, out, "goat", "--dtype", "bf16", "--force")[0] == 0
    assert "goat-dist format, bf16 weights" in (out / "README.md").read_text()


def test_a_directory_holding_only_a_model_card_is_exported_into(run_dir, tmp_path, capsys):
    out = tmp_path / "my-model"
    out.mkdir()
    (out / "README.md").write_text("---\nlicense: apache-2.0\n---\n# my model\n")
    card = snapshot(out)["README.md"]
    code, _, err = export(capsys, run_dir, out, "hf")
    assert code == 0, err
    assert snapshot(out)["README.md"] == card and (out / "model.safetensors").is_file()
    assert "README.md" not in json.loads((out / MARKER).read_text())["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]


def test_a_users_file_under_a_name_the_new_export_writes_is_refused(run_dir, tmp_path, capsys):
    """A goat-format export holds the user's modeling_goat.py; an HF export over it would write its own."""
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, "goat")[0] == 0
    (out / "modeling_goat.py").write_text("# mine\n")
    before = snapshot(out)
    code, _, err = export(capsys, run_dir, out, "hf", "--force")
    assert code == 2 and "modeling_goat.py" in err and "nothing was written" in err and err.count("\n") == 1
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def test_a_failed_rename_puts_everything_back(run_dir, tmp_path, capsys, monkeypatch):
    """The new export failing to take OUT's place: the previous export and the user's files are back."""
    import os

    from goat_dist.checkpoint import export as export_module

    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, "goat")[0] == 0
    (out / "notes.txt").write_text("my notes")
    before = snapshot(out)
    real = os.replace

    def failing(src, dst):
        if str(dst) == str(out) and ".replaced." not in str(src):
            raise OSError(5, "simulated I/O error")
        return real(src, dst)

    monkeypatch.setattr(export_module.os, "replace", failing)
    with pytest.raises(OSError, match="simulated"):
        export_module.export(run_dir, out, dtype="bf16", force=True)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def test_force_keeps_weights_written_over_a_previous_export_under_its_names(run_dir, tmp_path, capsys):
    """``save_pretrained`` into an export directory writes model.safetensors and config.json, the export's
    own names: the marker's sizes and times tell them apart, and --force refuses to replace them."""
    out = tmp_path / "exported"
    assert export(capsys, run_dir, out, "goat")[0] == 0
    (out / "model.safetensors").write_bytes(b"MY FINE-TUNED WEIGHTS")
    before = snapshot(out)
    code, _, err = export(capsys, run_dir, out, "goat", "--force")
    assert code == 2 and "model.safetensors (changed since the export)" in err and str(out) in err
    assert snapshot(out) == before


def test_an_empty_directory_is_used(run_dir, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert export(capsys, run_dir, out, "goat")[0] == 0
    assert (out / "model.safetensors").is_file() and (out / MARKER).is_file()


def test_a_file_as_out_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "model.bin"
    out.write_bytes(b"weights")
    code, _, err = export(capsys, run_dir, out, "goat", "--force")
    assert code == 2 and str(out) in err and "not a directory" in err
    assert out.read_bytes() == b"weights"


# ---------------------------------------------------------------- verify


def test_verify_says_ok_for_an_intact_checkpoint(run_dir, capsys):
    code, out, _ = ckpt(capsys, "verify", run_dir)
    assert code == 0 and out.startswith("OK: checkpoint") and "step_00000001" in out and "(step 1)" in out


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
def test_verify_names_the_corrupt_file(run_dir, tmp_path, capsys, damage):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step = copy / "checkpoints" / "step_00000001"
    victim = step / "universal" / "rank00000.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        victim.write_bytes(bytes(data[:-8]))
    else:
        victim.unlink()
    code, out, err = ckpt(capsys, "verify", step)
    assert code == 2 and not out
    assert "universal/rank00000.safetensors" in err and "step 1" in err and err.count("\n") == 1
    assert {"flipped": "sha256", "truncated": "truncated", "missing": "missing"}[damage] in err


def test_verify_of_something_else_names_it(tmp_path, capsys):
    code, _, err = ckpt(capsys, "verify", tmp_path)
    assert code == 2 and str(tmp_path) in err and "not a checkpoint" in err
