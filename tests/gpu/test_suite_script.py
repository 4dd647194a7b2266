"""``bench/gpu_suite.sh`` on any machine: its syntax and its ``--dry-run`` plan (every part with its
timeout, the inputs checked), so its first run on a GPU does not end on a typo. Needs no CUDA; the
suite itself leaves this file out of its tests/gpu run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu_suite.sh"


def dry_run(tmp_path, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GOAT_") and k != "OUT"}
    full = {**clean, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SUITE), "--dry-run", str(tmp_path / "out")], capture_output=True,
                          text=True, env=full, cwd=ROOT, timeout=120)  # fmt: skip


def test_suite_script_parses():
    proc = subprocess.run(["bash", "-n", str(SUITE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_prints_the_plan_and_finds_its_inputs(tmp_path):
    proc = dry_run(tmp_path, GOAT_TRAIN_TIMEOUT="77")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for part in ("rehearse", "install", "train", "tp2", "tests", "bench"):
        assert f"  {part} " in out and "timeout" in out.split(f"  {part} ")[1].splitlines()[0], out
    assert "train    timeout 77s: " in out and "bench/gpu_train.py --out" in out
    assert out.index("  rehearse ") < out.index("  install ")  # the rehearsal first
    assert "plan --config configs/models/goat_30b.yaml --nodes 64 --gpus-per-node 8 --rehearse" in out
    assert "bench/gpu_tp2.py --out" in out and "skipped with a message on one" in out
    assert "--only-binary=:all:" in out and "flash-attn-4" in out and "torch==" in out  # torch pinned
    assert "GOAT_TESTS_JSONL=" in out and "FA4 kernel cache: " in out
    assert "inputs: all present" in out
    assert not (tmp_path / "out").exists()  # a plan runs nothing and writes nothing


def test_dry_run_installs_the_cu13_libs_for_a_cuda13_torch_and_names_what_is_missing(tmp_path):
    """A CUDA 13 torch (faked on PYTHONPATH) gets flash-attn-4[cu13] with that torch pinned; and a Python
    that cannot import goat_dist is a missing input (exit 1), said by name."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.13.0+cu130"\nclass version:\n    cuda = "13.0"\n')
    proc = dry_run(tmp_path, PYTHONPATH=str(fake.parent))
    assert "flash-attn-4[cu13]>=" in proc.stdout and "torch==2.13.0+cu130" in proc.stdout, proc.stdout
    assert proc.returncode == 1 and "MISSING an importable goat_dist" in proc.stdout
    skipped = dry_run(tmp_path, GOAT_SKIP_INSTALL="1")
    assert "install  skipped" in skipped.stdout and skipped.returncode == 0


def test_tp2_part_skips_with_a_message_on_fewer_than_two_gpus(tmp_path):
    """bench/gpu_tp2.py on a machine without two GPUs: exit 0, a skip record naming why (its checks run
    on CPU with ``--cpu --precision fp32``, ~1 min: a manual check, not in the suite)."""
    import json

    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs: the suite's tp2 part runs the real thing")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_tp2.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "gpu_tp2.json").read_text())
    assert record["skipped"].startswith("needs 2 GPUs") and "skipped" in proc.stdout
