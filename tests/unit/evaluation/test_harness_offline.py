"""`eval harness --datasets-cache`: the environment it sets for lm-eval's datasets, and what it says when
the directory or a task's data set is not there (the run itself:
tests/integration/evaluation/test_harness.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from goat_dist.evaluation.harness import datasets_cache_env, unloadable

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def test_the_flag_takes_the_datasets_cache_or_the_hf_home_above_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "hf" / "datasets").mkdir(parents=True)
    (tmp_path / "copy").mkdir()
    assert datasets_cache_env(str(tmp_path / "copy")) == {
        "HF_DATASETS_CACHE": str(tmp_path / "copy"),
        **OFFLINE,
    }
    hf_home = {"HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"), **OFFLINE}
    assert datasets_cache_env(str(tmp_path / "hf")) == hf_home

    from goat_dist.evaluation import commands

    missing = tmp_path / "nowhere"
    for name in ("HF_DATASETS_CACHE", *OFFLINE):
        monkeypatch.delenv(name, raising=False)
    args = SimpleNamespace(eval="harness", tasks=["lambada_openai"], datasets_cache=str(missing))
    assert commands.cmd_harness(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"goat-dist eval harness: --datasets-cache {missing}: not a directory; pass the datasets cache "
        "copied from a machine where the tasks ran (its ~/.cache/huggingface/datasets, or "
        "~/.cache/huggingface)\n"
    )
    assert "HF_DATASETS_CACHE" not in os.environ and "HF_HUB_OFFLINE" not in os.environ


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)"),
        ValueError("Couldn't find cache for Rowan/hellaswag for config 'default'"),
    ],
)
def test_a_data_set_missing_from_the_cache_names_the_cache_and_its_layout(error):
    """A hub name datasets could not find in the cache (no copy at all, or not that config)."""
    message = unloadable("hellaswag", error, "/data/hf-datasets")
    assert message.startswith(
        "lm-eval task hellaswag: its data set is not in --datasets-cache /data/hf-datasets"
    )
    assert "Rowan/hellaswag" in message and "NAMESPACE___NAME/CONFIG/VERSION/HASH/" in message
    assert "--include-path DIR" in message
