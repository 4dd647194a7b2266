"""Batches are pinned on CUDA (the trainer's ``non_blocking`` copy is then asynchronous) and not on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from goat_dist.config import Config
from goat_dist.data import batches
from goat_dist.distributed import Layout


def layout(device: str) -> Layout:
    return Layout(
        world=1, rank=0, local_rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, device=torch.device(device)
    )


@pytest.mark.parametrize("device,pinned", [("cpu", False), ("cuda", True)])
def test_loaders_pin_on_cuda_only(device, pinned, monkeypatch):
    seen = {}
    monkeypatch.setattr(
        batches, "build_train_loader", lambda *a, **k: seen.setdefault("train", k["pin_memory"])
    )
    monkeypatch.setattr(batches, "build_val_loader", lambda *a, **k: seen.setdefault("val", k["pin_memory"]))
    cfg = Config()
    batches.train_loader(cfg, layout(device), sources=[])
    batches.val_loader(cfg, layout(device), sources=[])
    synthetic = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, synthetic="passkey"))
    loader = batches.train_loader(synthetic, layout(device), sources=[])
    assert seen == {"train": pinned, "val": pinned} and loader.pin_memory is pinned
