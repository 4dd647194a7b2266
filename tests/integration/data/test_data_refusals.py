"""Data a run or an evaluation cannot use, as a user meets it on the command line: one message naming the
file or setting and the fix, no traceback, exit 2, and nothing trained, evaluated or written. (The checks
themselves, in-process: tests/unit/data/test_data_checks.py and test_eval_data.py.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
from harness.multiproc import run
from harness.user_errors import one_clean_message, train


def copy_of_builtin(builtin_cache, to):
    shutil.copytree(next(p.parent for p in builtin_cache.glob("*/manifest.json")), to)
    return to


def test_train_refuses_a_deleted_shard_before_the_first_step(tmp_path, builtin_cache):
    data = copy_of_builtin(builtin_cache, tmp_path / "data")
    (data / "train-000000.tar").unlink()
    proc = train(tmp_path, f"data.source={data}", f"data.cache_dir={builtin_cache}")
    one_clean_message(proc, f"data.source={data}", "shard train-000000.tar is missing", "data.on_error=skip")
    assert "step 1" not in proc.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_refuses_data_without_a_val_split_when_evaluation_is_on(tmp_path, builtin_cache):
    """What ``data prepare --val-docs 0`` makes: fine for a run without evaluation, refused by name with."""
    data = copy_of_builtin(builtin_cache, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["val"] = []
    (data / "manifest.json").write_text(json.dumps(manifest))
    proc = train(tmp_path, f"data.source={data}", "train.eval_interval=5", f"data.cache_dir={builtin_cache}")
    one_clean_message(proc, "no validation shards", "train.eval_interval=5", "set train.eval_interval=0")


def test_eval_ppl_refuses_data_of_another_tokenizer(tmp_path, builtin_cache, world1):
    """An export whose tokenizer is not the builtin corpus's, evaluated on that corpus: refused by name,
    and no results file."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from goat_dist.config import ModelConfig
    from goat_dist.model import GPT

    cfg = ModelConfig(vocab_size=4096, seq_len=32, num_layers=1, hidden_size=64, num_heads=4)
    export = tmp_path / "export"
    export.mkdir()
    model = GPT(cfg)
    save_file(
        {k: v.detach().contiguous() for k, v in model.named_parameters()}, str(export / "model.safetensors")
    )
    (export / "config.json").write_text(json.dumps(asdict(cfg)))
    (export / "tokenizer.json").write_text("{}")
    data = next(p.parent for p in builtin_cache.glob("*/manifest.json"))
    cmd = [sys.executable, "-m", "goat_dist", "eval", "ppl", "--checkpoint", str(export), "--lengths", "32"]
    proc = run([*cmd, "--data", str(data)], expect=2, timeout=300)
    assert proc.stderr.count("goat-dist eval ppl:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{data} was tokenized with another tokenizer" in proc.stderr
    assert "--allow-other-tokenizer" in proc.stderr and not (export / "eval").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")
def test_harness_builtin_task_offline_says_how_to_run_it(tmp_path):
    """lm-eval's own task with the hub unreachable and no datasets cache: the task is named with the ways
    to run it offline, before any checkpoint is read (this one does not exist)."""
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = ["eval", "harness", "--checkpoint", str(tmp_path / "none"), "--tasks", "lambada_openai"]
    proc = run([sys.executable, "-m", "goat_dist", *cmd], expect=2, timeout=300, **offline)
    assert proc.stderr.count("goat-dist eval harness:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr[proc.stderr.index("goat-dist eval harness:") :]
    assert "lm-eval task lambada_openai: its data set could not be loaded" in message
    assert "--include-path DIR" in message and "HF_DATASETS_CACHE" in message
