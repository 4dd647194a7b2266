"""Sequential reads of token ranges from one epoch of one source's concatenated document stream.

Why: the loader asks for ranges of stream offsets (a block of windows at a time, ascending), and
the offsets come from the manifest's token counts. A shard that ends before the range is skipped
without being opened, which makes resuming deep into an epoch cheap; inside a shard the tar is
read from its start (tar has no index).

Bad data: with `on_error="raise"` a shard that can't be opened or decoded, or whose token count
differs from the manifest, raises ShardError naming the shard and sample. With `on_error="skip"`
the rest of that shard is logged once (logger `goat_dist.data`) and replaced by `fill_id` tokens
flagged as missing, so every later offset keeps its meaning and iteration stays deterministic.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data_tools.shard_format import ShardError
from goat_dist.data.shards import iter_documents
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
    """Reads ascending ranges of one epoch's token stream (shards in `order`)."""

    def __init__(self, split: SourceSplit, order: list[int], on_error: str, fill_id: int, warned: set):
        self.split = split
        self.order = order
        self.on_error = on_error
        self.fill_id = fill_id
        self.warned = warned  # shards already logged by this worker (shared across epochs)
        ends = np.cumsum([split.n_tokens[i] for i in order])
        self.shard_end = [int(x) for x in ends]
        self.next_shard = 0  # index into `order` of the next shard to open
        self.docs: Iterator[tuple[int, np.ndarray, bool]] | None = None
        self.doc: tuple[int, np.ndarray, bool] | None = None  # (start, ids, missing) last one served

    def _shard_docs(self, k: int) -> Iterator[tuple[int, np.ndarray, bool]]:
        """(start offset, ids, missing) of shard order[k]; unreadable data per the on_error policy."""
        url = self.split.shards[self.order[k]]
        expected = self.split.n_tokens[self.order[k]]
        pos = self.shard_end[k] - expected
        done = 0
        key = None
        try:
            for key, ids in iter_documents([url]):
                if done + ids.size > expected:
                    raise ShardError(
                        f"shard {url}: sample {key!r} goes past the {expected} tokens the manifest lists"
                    )
                yield pos + done, ids, False
                done += ids.size
            if done < expected:
                raise ShardError(
                    f"shard {url} ends after {done} of the {expected} tokens the manifest lists "
                    f"(last sample {key!r}); truncated shard?"
                )
        except ShardError as exn:
            if self.on_error != "skip":
                raise
            if url not in self.warned:
                self.warned.add(url)
                log.warning("skipping the rest of %s (%d tokens): %s", url, expected - done, exn)
            yield pos + done, np.broadcast_to(np.uint32(self.fill_id), (expected - done,)), True

    def _advance(self, pos: int) -> None:
        """Make self.doc the document holding offset `pos`."""
        while self.doc is None or self.doc[0] + self.doc[1].size <= pos:
            nxt = next(self.docs, None) if self.docs is not None else None
            if nxt is not None:
                self.doc = nxt
                continue
            while self.next_shard < len(self.order) and self.shard_end[self.next_shard] <= pos:
                self.next_shard += 1  # wholly before pos: skipped unopened
            if self.next_shard >= len(self.order):
                raise IndexError(f"offset {pos} is past the end of the epoch ({self.shard_end[-1]} tokens)")
            self.docs = self._shard_docs(self.next_shard)
            self.next_shard += 1

    def read(self, start: int, end: int) -> Span:
        """Tokens [start, end); `start` must not precede the document of the previous read's end."""
        if self.doc is not None and start < self.doc[0]:
            raise ValueError(f"reads must ascend: {start} precedes the current document at {self.doc[0]}")
        pieces, starts, holes = [], [], []
        pos = start
        while pos < end:
            self._advance(pos)
            doc_start, ids, missing = self.doc
            piece = ids[pos - doc_start : min(end, doc_start + ids.size) - doc_start]
            if not starts or starts[-1] != doc_start:
                starts.append(doc_start)
            if missing:
                holes.append((pos - start, pos - start + piece.size))
            pieces.append(piece)
            pos += piece.size
        tokens = np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])
        mask = None
        if holes:
            mask = np.zeros(end - start, dtype=bool)
            for a, z in holes:
                mask[a:z] = True
        return Span(start, end, tokens, np.asarray(starts, dtype=np.int64), mask)

    def close(self) -> None:
        if self.docs is not None:
            self.docs.close()
            self.docs = None
