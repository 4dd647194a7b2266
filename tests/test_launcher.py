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
