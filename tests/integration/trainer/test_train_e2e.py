"""`goat-dist train` end to end in a subprocess, on a tiny model and the builtin corpus."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from harness.multiproc import ROOT, clean_env


def run_goat(args, cwd, timeout=600):
    cmd = [sys.executable, "-m", "goat_dist", *args]
    env = clean_env(OMP_NUM_THREADS="2")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_train_writes_run_dir_and_learns(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    proc = run_goat(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "train.max_steps=30",
            "log.interval=5",
            "train.eval_interval=30",
            "train.warmup_steps=5",
            "model.num_layers=2",
            "model.hidden_size=128",
            "model.seq_len=128",
            "train.seed=3",
            f"data.cache_dir={builtin_cache}",
            "data.builtin_max_bytes=1000000",
            f"run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout: world 1 = TP 1 x CP 1 x DP 1" in proc.stdout
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 30 and cfg["model"]["hidden_size"] == 128
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = records[0]
    assert start["event"] == "start" and start["tp"] == 1 and start["dp"] == 1
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 5, 10, 15, 20, 25, 30]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    assert any("val_loss" in r for r in records)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_override_fails_before_work(tmp_path):
    proc = run_goat(["train", "train.max_stepz=3"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "train.max_stepz" in proc.stderr


def test_train_callbacks_entries_are_built_or_named_in_the_error():
    """``train.callbacks``: ``module:Name:args`` builds ``Name(*args)``; an entry that cannot be imported or
    built is a config error naming it."""
    import pytest
    from harness.faults import KillAfter

    from goat_dist.config import ConfigError
    from goat_dist.trainer.callbacks import load_callbacks

    (built,) = load_callbacks(["harness.faults:KillAfter:3-4"])
    assert isinstance(built, KillAfter) and list(built.steps) == [3, 4]
    with pytest.raises(ConfigError, match=r"train.callbacks\[1\]='no_such_module:Cb': cannot import"):
        load_callbacks(["harness.faults:KillAfter:3", "no_such_module:Cb"])
    with pytest.raises(ConfigError, match="has no callable Nope"):
        load_callbacks(["harness.faults:Nope"])
    with pytest.raises(ConfigError, match=r"KillAfter\('x'\) failed"):
        load_callbacks(["harness.faults:KillAfter:x"])


def test_an_unimportable_train_callback_fails_before_work(tmp_path):
    proc = run_goat(["train", "train.callbacks=[no_such_module:Cb]", f"run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.callbacks[0]='no_such_module:Cb': cannot import no_such_module" in proc.stderr
