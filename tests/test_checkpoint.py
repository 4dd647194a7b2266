"""Checkpoints: exact resume after SIGKILL, crash mid-save, SIGTERM, corrupt files. Multi-process, slow."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from multiproc import ROOT, clean_env, goat_train_command, per_step, records
from multiproc import run as run_cmd

pytestmark = pytest.mark.slow


def command(nproc: int, overrides: list[str]) -> list[str]:
    return goat_train_command(nproc, overrides)


def run(nproc, overrides, expect=0, timeout=400, **extra_env):
    return run_cmd(command(nproc, overrides), expect=expect, timeout=timeout, **extra_env)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker (torchrun's workers live in process groups of their own)."""
    import psutil

    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "run ended before the step was reached"
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(r.get("step", -1) >= step and "loss" in r for r in records(run_dir)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


@pytest.mark.parametrize(
    "nproc,layout", [(1, []), (4, ["parallel.tp=2", "parallel.zero_stage=2"])], ids=["1proc", "tp2xdp2-zero2"]
)
def test_sigkill_then_exact_resume(nproc, layout, tmp_path, builtin_cache):
    common = [*layout, "train.max_steps=30", "checkpoint.interval=10", f"data.cache_dir={builtin_cache}"]
    full = tmp_path / "full"
    run(nproc, [*common, f"run.dir={full}"])

    resumed = tmp_path / "resumed"
    proc = subprocess.Popen(
        command(nproc, [*common, f"run.dir={resumed}"]),
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_step(resumed, 23, proc)
    kill_tree(proc)
    assert (resumed / "checkpoints" / "latest").read_text() == "step_00000020"
    out = run(nproc, [*common, f"run.dir={resumed}"])
    assert "resumed from" in out.stdout and "step 20" in out.stdout

    expected, got = per_step(full), per_step(resumed)
    for step in range(21, 31):
        assert got[step] == expected[step], (
            f"step {step}: resumed {got[step]} vs uninterrupted {expected[step]}"
        )


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    common = [
        "train.max_steps=30",
        "checkpoint.interval=10",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    proc = subprocess.run(
        command(2, common),
        env=clean_env(GOAT_FAULT="before_publish:20"),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert proc.returncode != 0  # killed between writing the shards of step 20 and publishing them
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000010"
    assert (ckpts / "step_00000020").is_dir() and not (ckpts / "step_00000020" / "manifest.json").exists()
    out = run(2, common)
    assert "resumed from" in out.stdout and "step 10" in out.stdout
    assert (ckpts / "latest").read_text() == "step_00000030"
    assert max(per_step(run_dir)) == 30


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_and_exits_with_requeue_code(nproc, tmp_path, builtin_cache):
    """SIGTERM reaches every training process (as Slurm delivers it to all tasks of a job step): they agree
    at the next step boundary, publish a checkpoint and exit 75. Under torchrun the launcher itself then
    reports the workers' failure (its exit code is 1; the workers' 75 is in its report)."""
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        command(nproc, ["train.max_steps=100000", f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"]),
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(run_dir, 5, proc)
    sent = time.time()
    workers = [proc.pid] if nproc == 1 else [c.pid for c in psutil.Process(proc.pid).children()]
    assert len(workers) == nproc
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    if nproc == 1:
        assert proc.returncode == 75, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    else:
        assert "exitcode  : 75" in err, err[-3000:]
    assert time.time() - sent < 60
    latest = (run_dir / "checkpoints" / "latest").read_text()
    step = int(latest.split("_")[1])
    assert step >= 5 and (run_dir / "checkpoints" / latest / "manifest.json").is_file()
    assert max(per_step(run_dir)) == step  # stopped at the boundary right after the signal


def test_truncated_checkpoint_file_is_named(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    common = ["train.max_steps=4", f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"]
    run(1, common)
    shard = run_dir / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    out = run(1, ["train.max_steps=8", *common[1:]], expect=2)
    assert "mp_rank_00_model_states.pt" in out.stderr and "step 4" in out.stderr


LAYOUT_CHANGES = [
    ("tp2-to-tp1", 2, ["parallel.tp=2"], 1, []),
    ("tp1-to-tp2", 1, [], 2, ["parallel.tp=2"]),
    ("dp2-to-dp1", 2, ["parallel.zero_stage=1"], 1, []),
    ("dp1-to-dp2", 1, [], 2, ["parallel.zero_stage=2"]),
    ("zero1-to-zero3", 2, ["parallel.zero_stage=1"], 2, ["parallel.zero_stage=3"]),
    ("zero3-to-tp2", 2, ["parallel.zero_stage=3"], 2, ["parallel.tp=2"]),
]


@pytest.mark.parametrize("name,n_old,old,n_new,new", LAYOUT_CHANGES, ids=[c[0] for c in LAYOUT_CHANGES])
def test_resume_on_another_layout(name, n_old, old, n_new, new, tmp_path, builtin_cache):
    common = ["train.max_steps=12", f"data.cache_dir={builtin_cache}"]
    before = tmp_path / "before"
    run(n_old, [*common, *old, "checkpoint.interval=10", f"run.dir={before}"])
    after = tmp_path / "after"
    out = run(n_new, [*common, *new, f"train.resume={before}/checkpoints/step_00000010", f"run.dir={after}"])
    assert "resumed from" in out.stdout
    expected, got = per_step(before), per_step(after)
    for step in (11, 12):
        assert abs(got[step][0] - expected[step][0]) <= 1e-4 * expected[step][0], f"{name} step {step}"
        assert got[step][1] == expected[step][1], f"{name} step {step}: different data"
