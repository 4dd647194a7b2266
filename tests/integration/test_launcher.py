"""Child processes start clean: no parent world's launcher variables, and DeepSpeed told the machine's
accelerator (cuda where a GPU is visible: a CUDA child told "cpu" would build a CPU engine)."""

from __future__ import annotations

import torch

from goat_dist.launcher import child_env


def test_child_env_drops_launcher_variables_and_names_the_accelerator(monkeypatch):
    base = {"RANK": "3", "MASTER_PORT": "29500", "PATH": "/bin"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert child_env(base) == {"PATH": "/bin", "DS_ACCELERATOR": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert child_env(base)["DS_ACCELERATOR"] == "cuda"
    assert child_env({**base, "DS_ACCELERATOR": "cpu"})["DS_ACCELERATOR"] == "cpu"  # an explicit choice wins


WORKER = "import os, sys; sys.exit({other} if int(os.environ['RANK']) else {rank0})"


def test_world_passes_a_usage_error_on_without_torchruns_report(tmp_path):
    """``run_world`` (``goat-dist train --nproc``): rank 0's exit 2 is the world's, with no ChildFailedError
    report; any other failure is exit 1 in one line."""
    import subprocess
    import sys

    def world(rank0: int, other: int):
        code = (
            "import sys; from goat_dist.launcher import run_world; "
            f"sys.exit(run_world(2, ['-c', {WORKER.format(rank0=rank0, other=other)!r}]))"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    usage = world(2, 0)
    assert (
        usage.returncode == 2 and "ChildFailedError" not in usage.stderr and "Traceback" not in usage.stderr
    )
    crash = world(3, 0)
    assert crash.returncode == 1 and "rank 0 of 2 failed with exit code 3" in crash.stderr
    assert world(0, 0).returncode == 0
