"""Pack tokenized documents into fixed-length training sequences (GPT-style concatenation).

Why: a decoder LM trains on full-length windows; concatenating documents (each ends with EOS)
and cutting the stream wastes no padding and needs no attention masks beyond the causal one.

Stream layout per epoch (`epoch = 0, 1, ...`):
  * shards are read in `shard_order(epoch)`, a permutation seeded by (seed, epoch); documents
    keep their order inside a shard;
  * the token stream is cut into windows of `seq_len + 1` tokens with stride `seq_len`
    (consecutive windows share one token), so every token after the first is a target exactly
    once; window n gives tokens = w[:-1], labels = w[1:];
  * the tail shorter than a window is dropped at the end of each epoch, so each epoch is a pure
    function of (shards, seq_len, seed, epoch), which makes later exact resume simple.

Shuffling: windows pass through a seeded shuffle buffer (`shuffle_buffer` windows, seeded by
(seed, epoch)) before the data-parallel split, so a batch mixes documents from several shards
instead of holding consecutive windows of one file. The buffer is the same on every rank and
worker, so the split below is unchanged; `shuffle_buffer=0` keeps the stream order.

Data parallelism: window n goes to rank `n % dp_size` (explicit `dp_rank`/`dp_size`, never the
RANK environment variable), so ranks get disjoint windows and interleaving the ranks' streams
gives the DP=1 stream.

DataLoader workers: with `num_workers=W`, worker w of a rank yields that rank's windows number
w, w+W, w+2W, ... (window n of the epoch is taken by the worker with
`n % (dp_size * W) == dp_rank + dp_size * w`). The union over workers is exactly the rank's
`num_workers=0` stream; the DataLoader returns it interleaved batch by batch (worker 0's first
batch, worker 1's first batch, ...), so the order differs from `num_workers=0` unless W = 1.
Every worker reads and decodes all shards and skips the windows of others; that costs IO, not
compute, and keeps the split exact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from goat_dist.data.shards import iter_documents

# Documents are buffered until at least this many tokens (or one window) are pending, so the
# concatenate/cut step runs on large arrays rather than once per small document.
_MIN_CHUNK_TOKENS = 1 << 16


class PackedSequences(IterableDataset):
    """Infinite stream of packed training sequences over tar shards.

    Yields dicts of LongTensors of length `seq_len`: "tokens", "labels" (next-token targets,
    labels[i] == tokens[i + 1] within the stream) and "position_ids" (0..seq_len-1).
    """

    def __init__(
        self,
        shard_paths: Sequence[str | os.PathLike],
        seq_len: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle_buffer: int = 0,
    ):
        super().__init__()
        if isinstance(shard_paths, (str, os.PathLike)):
            raise TypeError("shard_paths must be a list of paths, not a single path")
        self.shard_paths = [os.fspath(p) for p in shard_paths]
        if not self.shard_paths:
            raise ValueError("PackedSequences needs at least one shard")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle_buffer = shuffle_buffer

    def shard_order(self, epoch: int) -> list[str]:
        """Shard paths in the order read during `epoch` (same on every rank and worker)."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.shard_paths))
        return [self.shard_paths[i] for i in perm]

    def iter_windows(self, epoch: int) -> Iterator[np.ndarray]:
        """All windows of `epoch` for all ranks, each `seq_len + 1` tokens (views; don't keep them)."""
        stride, width = self.seq_len, self.seq_len + 1
        threshold = max(width, _MIN_CHUNK_TOKENS)
        pending: list[np.ndarray] = []
        n_pending = 0
        for _, ids in iter_documents(self.shard_order(epoch)):
            pending.append(ids)
            n_pending += ids.size
            if n_pending < threshold:
                continue
            buf = np.concatenate(pending)
            n = (buf.size - 1) // stride
            for i in range(n):
                yield buf[i * stride : i * stride + width]
            rest = buf[n * stride :]  # < width tokens; its first token is the last window's last one
            pending, n_pending = [rest], rest.size
        if n_pending >= width:
            buf = np.concatenate(pending)
            for i in range((buf.size - 1) // stride):
                yield buf[i * stride : i * stride + width]

    def shuffled_windows(self, epoch: int) -> Iterator[np.ndarray]:
        """``iter_windows(epoch)`` through a seeded shuffle buffer (copies; safe to keep)."""
        if self.shuffle_buffer <= 1:
            yield from self.iter_windows(epoch)
            return
        rng = np.random.default_rng([self.seed, epoch, 1])
        buf: list[np.ndarray] = []
        for window in self.iter_windows(epoch):
            if len(buf) < self.shuffle_buffer:
                buf.append(window.copy())
                continue
            j = int(rng.integers(len(buf)))
            yield buf[j]
            buf[j] = window.copy()
        for j in rng.permutation(len(buf)):
            yield buf[j]

    def _sample(self, window: np.ndarray) -> dict[str, torch.Tensor]:
        # astype copies, so samples don't keep the shared concatenation buffer alive
        return {
            "tokens": torch.from_numpy(window[:-1].astype(np.int64)),
            "labels": torch.from_numpy(window[1:].astype(np.int64)),
            "position_ids": torch.arange(self.seq_len, dtype=torch.long),
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        consumers = self.dp_size * n_workers
        mine = self.dp_rank + self.dp_size * worker
        epoch = 0
        while True:
            n_windows = 0
            for n, window in enumerate(self.shuffled_windows(epoch)):
                n_windows = n + 1
                if n % consumers == mine:
                    yield self._sample(window)
            if n_windows == 0:
                raise ValueError(
                    f"the {len(self.shard_paths)} shard(s) hold fewer than seq_len + 1 = {self.seq_len + 1} "
                    f"tokens; no training sequence can be formed (first shard: {self.shard_paths[0]})"
                )
            if n_windows < consumers:
                raise ValueError(
                    f"an epoch has only {n_windows} sequences of length {self.seq_len}, fewer than "
                    f"dp_size * num_workers = {consumers}; some consumers would never get data"
                )
            epoch += 1
