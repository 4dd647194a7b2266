"""Token ranges of one epoch of one source's concatenated document stream, read by offset.

Why: the loader asks for the window of each of its own samples (a rank of a dp-way job wants 1/dp of
the stream, scattered over it). Stream offset -> (shard, shard-local token) is a binary search over the
epoch's shard ends, and the shard's index turns that into byte offsets (`shard_index.ShardFile`), so a
window costs its own bytes, whatever was read before it and in whatever order.

Bad data: with `on_error="raise"` a shard that can't be opened, is shorter than its manifest says, or
holds token ids outside the vocabulary raises ShardError naming the shard (and the sample where it is
known) at the first read that touches it. With `on_error="skip"` the shard is logged once per process
(logger `goat_dist.data`) and its unreadable tokens (all of it, or the documents past the point where
it was cut) are replaced by `fill_id` tokens flagged as missing, so every later offset keeps its meaning
and iteration stays deterministic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from data_tools.shard_format import ShardError
from goat_dist.data.shard_index import ShardFiles
from goat_dist.data.sources import SourceSplit

log = logging.getLogger("goat_dist.data")


@dataclass
class Span:
    """Tokens [start, end) of the epoch stream with their document starts.

    `doc_starts` is ascending and begins with the start of the document holding `start` (<= start).
    `missing` flags unreadable tokens (None when all were read).
    """

    start: int
    end: int
    tokens: np.ndarray
    doc_starts: np.ndarray
    missing: np.ndarray | None


class EpochReader:
    """Reads any range of one epoch's token stream (its shards concatenated in `order`)."""

    def __init__(
        self,
        split: SourceSplit,
        order: list[int],
        on_error: str,
        fill_id: int,
        warned: set,
        files: ShardFiles,
    ):
        self.split = split
        self.order = order
        self.on_error = on_error
        self.fill_id = fill_id
        self.warned = warned  # shards already logged by this process (shared across epochs)
        self.files = files
        counts = np.asarray([split.n_tokens[i] for i in order], dtype=np.int64)
        self.shard_end = np.cumsum(counts)
        self.shard_start = self.shard_end - counts

    def _skip(self, location: str, exn: ShardError, n: int) -> None:
        if self.on_error != "skip":
            raise exn
        if location not in self.warned:
            self.warned.add(location)
            log.warning("skipping unreadable tokens of %s (%d here): %s", location, n, exn)

    def read(self, start: int, end: int) -> Span:
        """Tokens [start, end) of the epoch stream."""
        total = int(self.shard_end[-1]) if len(self.shard_end) else 0
        if start < 0 or end > total or start >= end:
            raise IndexError(f"tokens [{start}, {end}) are not inside the epoch ({total} tokens)")
        tokens = np.empty(end - start, dtype=np.int64)
        starts: list[np.ndarray] = []
        mask = None
        k = int(np.searchsorted(self.shard_end, start, side="right"))
        pos = start
        while pos < end:
            s0 = int(self.shard_start[k])
            a, b = pos - s0, min(end, int(self.shard_end[k])) - s0
            k += 1
            if b <= a:
                continue  # a shard with no tokens
            i = self.order[k - 1]
            location = self.split.shards[i]
            entry = self.split.entries[i] if self.split.entries else {}
            shard = self.files.get(location, entry, self.split.n_tokens[i], self.split.vocab_size)
            good = b
            if shard.error is not None:
                good = max(a, min(b, shard.readable_until))
                if good < b or self.on_error != "skip":
                    self._skip(location, shard.error, b - good)
            if a < good:
                try:
                    tokens[s0 + a - start : s0 + good - start] = shard.read(a, good)
                    starts.append(s0 + shard.doc_starts(a, good))
                except ShardError as exn:
                    self._skip(location, exn, good - a)
                    good = a
            if good < b:  # unreadable: one filler "document", so positions and offsets keep their meaning
                if mask is None:
                    mask = np.zeros(end - start, dtype=bool)
                mask[s0 + good - start : s0 + b - start] = True
                tokens[s0 + good - start : s0 + b - start] = self.fill_id
                starts.append(np.asarray([s0 + good], dtype=np.int64))
            pos = s0 + b
        return Span(start, end, tokens, np.concatenate(starts).astype(np.int64), mask)
