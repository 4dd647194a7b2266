"""Helpers of the data-loader tests (unit and integration): data sets of documents holding consecutive ids,
the shards a loader opens, the first batches of a loader, and whether two lists of batches are the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data_tools.writer import ShardWriter


def consecutive_splits(
    root: Path,
    counts: dict[str, int],
    rng: np.random.Generator,
    lengths: tuple[int, int],
    shard_mb: float,
    vocab_size: int,
    first: int = 0,
    key_digits: int = 5,
) -> tuple[dict[str, list[dict]], int]:
    """Write ``counts[split]`` documents per split (in the dict's order) under ``root``: document ``d`` is
    ``doc-<d>`` (``key_digits`` digits), of a length ``rng.integers(*lengths)``, holding the next consecutive
    ids from ``first`` (mod ``vocab_size``), so that a window's first token names its place in the stream.
    Returns each split's shards (the manifest's ``splits``) and the id after the last."""
    splits, pos = {}, first
    for split, count in counts.items():
        with ShardWriter(root, split, shard_mb, vocab_size=vocab_size) as w:
            for d in range(count):
                n = int(rng.integers(*lengths))
                w.write(f"doc-{d:0{key_digits}d}", np.arange(pos, pos + n) % vocab_size)
                pos += n
        splits[split] = w.shards
    return splits, pos


def count_shard_opens(monkeypatch) -> list:
    """The location of every shard file the loader opens (``shard_index.ShardFile``) from now on in this
    test, in order."""
    from goat_dist.data import shard_index

    opened = []
    real_init = shard_index.ShardFile.__init__

    def counting_init(self, location, *args):
        opened.append(location)
        real_init(self, location, *args)

    monkeypatch.setattr(shard_index.ShardFile, "__init__", counting_init)
    return opened


def batches(loader, n: int) -> list[dict]:
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it
    return out


def same(xs: list[dict], ys: list[dict]) -> bool:
    keys = ("tokens", "labels", "position_ids")
    return len(xs) == len(ys) and all(torch.equal(x[k], y[k]) for x, y in zip(xs, ys) for k in keys)
