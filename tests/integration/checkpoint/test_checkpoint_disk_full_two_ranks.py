"""A full disk on one rank during a real two-rank ``goat-dist train`` save: one message naming the
directory and the bytes, exit 2, no traceback, no hang; the previous checkpoint stays ``latest`` and
verifies. (The paths of each write, in-process: ``tests/unit/checkpoint/test_checkpoint_disk_full.py``.)"""

from __future__ import annotations

import sys

import pytest
from harness.faults import fault_env
from harness.multiproc import TINY, run

from goat_dist.cli import main

pytestmark = pytest.mark.slow


def test_a_full_disk_on_rank_1_stops_both_ranks_with_one_message(tmp_path, builtin_cache, capsys):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "goat_dist", "train", "--nproc", "2", *TINY, f"run.dir={run_dir}"]
    overrides = [
        f"data.cache_dir={builtin_cache}",
        "train.max_steps=4",
        "checkpoint.interval=2",
        "train.callbacks=[harness.disk_faults:DiskFullAt:4:1]",
    ]
    proc = run([*cmd, *overrides], expect=2, timeout=300, **fault_env())
    out = proc.stdout + proc.stderr
    assert out.count("goat-dist train:") == 1 and "Traceback" not in out, out[-3000:]
    message = proc.stderr[proc.stderr.index("goat-dist train:") :]
    step_dir = run_dir / "checkpoints" / "step_00000004"
    for words in (
        "writing universal/rank00001.safetensors failed",
        f"The disk holding {step_dir / 'universal'} is full",
        "bytes are free",
        "step_00000002 stays `latest`",
        "found on rank 1",
    ):
        assert words in message, message
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not step_dir.exists()
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    assert "OK: checkpoint" in capsys.readouterr().out
