"""The data contract on resume: a changed data stream is refused (or restarted on request); a layout
change is not a contract change."""

from __future__ import annotations

import pytest
from harness.multiproc import assert_config_is_the_runs, goat_train_command, per_step, records, run

from goat_dist.data.contract import DataContractError, check, differences

CONTRACT = {
    "sources": [{"path": "/data/a", "weight": 1.0, "manifest": "aa" * 32}],
    "tokenizer_sha256": ["t1"],
    "seq_len": 64,
    "seed": 1,
    "shuffle_buffer": 1024,
    "document_masking": False,
}


def test_differences_name_each_key_old_to_new():
    new = {**CONTRACT, "seq_len": 128, "seed": 2, "sources": [{**CONTRACT["sources"][0], "weight": 0.5}]}
    assert differences(CONTRACT, new) == [
        "seq_len: 64 -> 128",
        "seed: 1 -> 2",
        "sources[0].weight: 1.0 -> 0.5",
    ]
    moved = {**CONTRACT, "sources": [{**CONTRACT["sources"][0], "path": "/scratch/a"}]}
    assert differences(CONTRACT, moved) == []  # data moved, same manifest: the same stream
    with pytest.raises(DataContractError, match="seq_len: 64 -> 128"):
        check(CONTRACT, new, "check", "ckpt")
    assert check(CONTRACT, new, "restart", "ckpt") is True
    assert check(None, new, "check", "ckpt") is False  # a checkpoint from before contracts


@pytest.mark.slow
def test_resume_refuses_restarts_and_ignores_layout(tmp_path, builtin_cache):
    first = tmp_path / "first"
    common = [f"data.cache_dir={builtin_cache}", "checkpoint.interval=4"]
    run(goat_train_command(1, [*common, "train.max_steps=6", f"run.dir={first}"]))
    ckpt = first / "checkpoints" / "step_00000004"

    refused = tmp_path / "refused"
    out = run(
        goat_train_command(
            1,
            [
                *common,
                "train.max_steps=6",
                "data.shuffle_buffer=16",
                "train.seed=7",
                f"train.resume={ckpt}",
                f"run.dir={refused}",
            ],
        ),
        expect=2,
    )
    assert "resume from" in out.stderr and "refused" in out.stderr
    assert "seed: 1234 -> 7" in out.stderr and "shuffle_buffer: 1024 -> 16" in out.stderr

    # restart: the new stream from its sample 0, as a fresh run with the new settings sees it
    restarted = tmp_path / "restarted"
    out = run(
        goat_train_command(
            1,
            [
                *common,
                "train.max_steps=6",
                "data.shuffle_buffer=16",
                "train.data_resume=restart",
                f"train.resume={ckpt}",
                f"run.dir={restarted}",
            ],
        )
    )
    assert (
        "data stream restarted at its sample 0" in out.stdout and "shuffle_buffer: 1024 -> 16" in out.stdout
    )
    fresh = tmp_path / "fresh"
    run(goat_train_command(1, [*common, "train.max_steps=2", "data.shuffle_buffer=16", f"run.dir={fresh}"]))
    assert [per_step(restarted)[s][1] for s in (5, 6)] == [per_step(fresh)[s][1] for s in (1, 2)]
    assert [r["step"] for r in records(restarted) if "loss" in r][0] == 5

    # a later resume of the restarted run continues its new stream (the restart point is kept)
    out = run(
        goat_train_command(
            1, [*common, "train.max_steps=8", "data.shuffle_buffer=16", f"run.dir={restarted}"]
        )
    )
    assert "data stream restarted" not in out.stdout
    run(goat_train_command(1, [*common, "train.max_steps=4", "data.shuffle_buffer=16", f"run.dir={fresh}"]))
    assert [per_step(restarted)[s][1] for s in (7, 8)] == [per_step(fresh)[s][1] for s in (3, 4)]
    assert assert_config_is_the_runs(restarted)["data"]["shuffle_buffer"] == 16

    # another layout (DP=2, ZeRO-2) is not a contract change
    other = tmp_path / "other"
    out = run(
        goat_train_command(
            2,
            [
                *common,
                "parallel.zero_stage=2",
                "train.max_steps=6",
                f"train.resume={ckpt}",
                f"run.dir={other}",
            ],
        )
    )
    assert "resumed from" in out.stdout and "data stream restarted" not in out.stdout
    assert [per_step(other)[s][1] for s in (5, 6)] == [per_step(first)[s][1] for s in (5, 6)]
    assert assert_config_is_the_runs(other)["parallel"]["zero_stage"] == 2
