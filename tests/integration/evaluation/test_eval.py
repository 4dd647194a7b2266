"""`goat-dist eval ppl` and `goat-dist eval passkey` on a tiny trained checkpoint, as a user runs them."""

from __future__ import annotations

import json
import sys

import pytest
from harness.multiproc import goat_train_command, launch_command, records, run
from PIL import Image

pytestmark = pytest.mark.slow


def eval_command(nproc: int, *args: str) -> list[str]:
    return launch_command(nproc, ["-m", "goat_dist", "eval", *args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_cache):
    """12 steps of the TINY model (context 64) on a prepared data directory given by path (the builtin
    corpus's, as a user's own corpus is given), with an empty ``data.cache_dir``; its last validation used
    2 x 2 windows of 64 tokens."""
    root = tmp_path_factory.mktemp("eval")
    run_dir, data = root / "run", next(p.parent for p in builtin_cache.glob("*/manifest.json"))
    (root / "empty-cache").mkdir()
    run(goat_train_command(1, ["train.max_steps=12", "train.eval_interval=12", "train.eval_batches=2",
                               f"data.source={data}", f"data.cache_dir={root / 'empty-cache'}",
                               f"run.dir={run_dir}"]))  # fmt: skip
    return run_dir


def png_ok(path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def ppl_json(out) -> dict:
    """The one data set's results in ``out`` (``ppl_<data set>_<split>.json``)."""
    (path,) = out.glob("ppl_*.json")
    return json.loads(path.read_text())


def test_ppl_json_png_and_the_trainers_own_validation_loss(trained, tmp_path, builtin_cache):
    """Without --data: the run's own data set (its config's data.source), and nothing built in the run's
    data.cache_dir (the builtin corpus is not what it trained on; training left only peak_flops.json)."""
    out = tmp_path / "ppl"
    args = ["--checkpoint", str(trained), "--lengths", "64,128,256", "--tokens", "256", "--out", str(out)]
    proc = run(eval_command(1, "ppl", *args))
    (path,) = out.glob("ppl_builtin-stdlib-*_val.json")
    report = json.loads(path.read_text())
    assert report["data"] == str(next(p.parent for p in builtin_cache.glob("*/manifest.json")))
    assert not list((trained.parent / "empty-cache").glob("**/manifest.json"))  # no data set built
    assert report["tokenizer_check"] == "same as training"
    assert report["position"] == "goat" and report["train_seq_len"] == 64 and report["step"] == 12
    assert "non-overlapping" in report["protocol"] and report["tp"] == 1
    results = {r["length"]: r for r in report["results"]}
    assert [results[n]["windows"] for n in (64, 128, 256)] == [4, 2, 1]
    assert all(r["tokens"] == 256 for r in results.values())
    # the first 4 validation windows of 64 are exactly what the trainer evaluated at step 12
    val_loss = [r for r in records(trained) if "val_loss" in r][-1]["val_loss"]
    assert results[64]["loss"] == pytest.approx(val_loss, rel=1e-5)
    blocks = results[256]["loss_by_position"]
    assert [(b["start"], b["end"]) for b in blocks] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert results[256]["ppl"] == pytest.approx(2.718281828 ** results[256]["loss"], rel=1e-6)
    assert png_ok(path.with_suffix(".png"))[0] > 400 and f"wrote {path}" in proc.stdout


def test_passkey_grid_json_and_png(trained, tmp_path):
    out = tmp_path / "passkey"
    proc = run(eval_command(1, "passkey", "--checkpoint", str(trained / "checkpoints"), "--lengths", "64,128",
                            "--depths", "0.2,0.8", "--samples", "3", "--out", str(out)))  # fmt: skip
    report = json.loads((out / "passkey.json").read_text())
    assert (
        report["lengths"] == [64, 128] and report["depths"] == [0.2, 0.8] and report["samples_per_cell"] == 3
    )
    assert len(report["accuracy"]) == 2 and all(len(row) == 2 for row in report["accuracy"])
    assert all(0.0 <= a <= 1.0 for row in report["accuracy"] for a in row)
    assert len(report["digit_accuracy"]) == 2 and all(
        0.0 <= a <= 1.0 for row in report["digit_accuracy"] for a in row
    )
    assert not report["trained_on_passkey"] and "not trained with data.synthetic=passkey" in proc.stdout
    assert png_ok(out / "passkey.png")[0] > 300


def test_tensor_parallel_eval_under_torchrun_matches_one_process(trained, tmp_path):
    args = ["ppl", "--checkpoint", str(trained), "--lengths", "64,256", "--tokens", "256"]
    run(eval_command(1, *args, "--out", str(tmp_path / "tp1")))
    run(eval_command(2, *args, "--out", str(tmp_path / "tp2")))
    one, two = (ppl_json(tmp_path / d) for d in ("tp1", "tp2"))
    assert (one["tp"], two["tp"]) == (1, 2)
    for a, b in zip(one["results"], two["results"]):
        assert a["length"] == b["length"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_learned_positions_cannot_extrapolate(world1, tmp_path, builtin_cache):
    """An export directory (model.safetensors + config.json) loads too; beyond the table is a clear error."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from data_tools.builtin import builtin_dataset_dir
    from goat_dist.config import ModelConfig
    from goat_dist.model import GPT

    cfg = ModelConfig(
        vocab_size=4096, seq_len=32, num_layers=1, hidden_size=64, num_heads=4, position="learned"
    )
    model = GPT(cfg)
    export = tmp_path / "learned"
    export.mkdir()
    save_file(
        {k: v.detach().contiguous() for k, v in model.named_parameters()}, str(export / "model.safetensors")
    )
    (export / "config.json").write_text(json.dumps(asdict(cfg)))
    data = builtin_dataset_dir(builtin_cache, 4096, 1_000_000)
    proc = run(
        eval_command(1, "ppl", "--checkpoint", str(export), "--lengths", "32,64", "--data", str(data)),
        expect=2,
    )
    assert "learned cannot extrapolate" in proc.stderr and "32" in proc.stderr
    assert not list((export / "eval").glob("ppl_*"))


def test_bad_lengths_are_usage_errors():
    proc = run(
        [sys.executable, "-m", "goat_dist", "eval", "ppl", "--checkpoint", "x", "--lengths", "0,64"], expect=2
    )
    assert "positive integers" in proc.stderr
