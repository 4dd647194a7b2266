"""Helpers of the data-loader tests (unit and integration): the first batches of a loader, and whether two
lists of batches are the same."""

from __future__ import annotations

import torch


def batches(loader, n: int) -> list[dict]:
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it
    return out


def same(xs: list[dict], ys: list[dict]) -> bool:
    keys = ("tokens", "labels", "position_ids")
    return len(xs) == len(ys) and all(torch.equal(x[k], y[k]) for x, y in zip(xs, ys) for k in keys)
