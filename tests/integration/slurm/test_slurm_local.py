"""launch/local.sh: one node under torchrun with slurm/train.sbatch's arguments: preflight, train, stop with
a checkpoint on SIGTERM (exit 75), continue with the same command, and bounded restarts after crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from harness.faults import fault_env, fault_override
from harness.multiproc import ROOT, TINY, clean_env, per_step

pytestmark = pytest.mark.slow


def local(args: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "launch/local.sh", *args],
        env=clean_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a signal to the script only, as a scheduler or `kill` would send it
    )


def test_local_stop_and_continue(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    args = ["--nproc", "1", "configs/tiny.yaml", *TINY, f"data.cache_dir={builtin_cache}"]
    args += ["train.max_steps=100000", f"run.dir={run_dir}"]  # longer than any wait: SIGTERM ends it
    proc = local(args)
    deadline = time.monotonic() + 240
    while (
        time.monotonic() < deadline
        and len(per_step(run_dir) if (run_dir / "metrics.jsonl").exists() else {}) < 5
    ):
        time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 75, out[-4000:]
    assert "goat-dist doctor: all checks passed" in out and "run the same command again" in out
    stopped = json.loads((run_dir / "last_exit.json").read_text())
    assert stopped["status"] == "checkpointed" and stopped["reason"] == "SIGTERM" and stopped["step"] >= 5

    again = local([a if a != "train.max_steps=100000" else "train.max_steps=20" for a in args])
    out, _ = again.communicate(timeout=300)
    if stopped["step"] >= 20:  # this machine was fast: nothing left to train, the run is finished
        assert again.returncode == 0, out[-4000:]
    else:
        assert again.returncode == 0 and f"resumed from {run_dir / 'checkpoints'}" in out, out[-4000:]
        assert max(per_step(run_dir)) == 20


def test_local_crash_restarts_are_bounded(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    args = [
        "--nproc",
        "1",
        "--max-restarts",
        "1",
        "configs/tiny.yaml",
        *TINY,
        f"data.cache_dir={builtin_cache}",
    ]
    args += ["train.max_steps=10", "checkpoint.interval=3", f"run.dir={run_dir}"]
    args.append(fault_override("KillBeforePublish:3"))  # a test callback: SIGKILL while saving step 3
    proc = local(args, **fault_env())
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 1, out[-4000:]
    tries = [json.loads(line) for line in (run_dir / "slurm" / "attempts.jsonl").read_text().splitlines()]
    assert [(t["status"], t["action"]) for t in tries] == [("failed", "requeue"), ("failed", "give-up")]
    assert out.count("training (attempt") == 2 and "giving up" in out
