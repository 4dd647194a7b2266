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

Remote shards (`ShardPrefetch`): a process's sample sequence is known in advance (the schedule is
arithmetic), so a background thread walks it ahead of the reader and stages the next remote shards of the
stream before the reader reaches them; the step waits on a download only for the first shard, or when the
cache's budget has no room for the next ones.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from data_tools.shard_format import ShardError
from goat_dist.config import ConfigError
from goat_dist.data.shard_index import (
    PREFETCH_SHARDS,
    REMOTE_OPEN,
    RemoteCache,
    RemotePin,
    ShardFiles,
    remote_cache,
)
from goat_dist.data.shards import is_url
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


def shard_sequence(split: SourceSplit, schedule, order_cache: dict, j: int) -> list[int]:
    """Manifest indices of the shards that sample `j` of a source's stream reads (its window's tokens)."""
    epoch, _, w = schedule.locate(j)
    if order_cache.get("epoch") != epoch:
        order = schedule.shard_order(epoch)
        order_cache.update(epoch=epoch, order=order, ends=np.cumsum([split.n_tokens[i] for i in order]))
    order, ends = order_cache["order"], order_cache["ends"]
    L = schedule.seq_len
    first = int(np.searchsorted(ends, w * L, side="right"))
    last = int(np.searchsorted(ends, w * L + L, side="right"))
    return [order[k] for k in range(first, last + 1) if split.n_tokens[order[k]]]


def reads_whole_epoch(schedule) -> bool:
    """Whether consecutive samples of the source come from anywhere in it (``window_order=epoch``,
    shuffled), rather than from a few shards at a time."""
    return getattr(schedule, "window_order", None) == "epoch" and bool(
        getattr(schedule, "shuffle_windows", 0)
    )


@dataclass
class RemotePlan:
    """How a loader stages its remote sources: the cache, how many remote shards a process keeps open
    (pinned), how far each source is prefetched, and the prefetcher's share of the budget."""

    cache: RemoteCache
    remote_open: int
    depth: list[int]  # per source: shards listed ahead of the one being read
    whole: list[bool]  # per source: read all at once (window_order=epoch), kept staged and open
    allowance: int | None  # bytes the prefetcher may hold; None: no limit
    close_passed: bool  # close the shards the stream has passed (the budget cannot hold them all)


def plan_remote(splits, schedules, cache_dir, cache_max_gb=None, remote_cache_dir=None) -> RemotePlan | None:
    """The plan of a loader's remote sources (None without any), checked before any worker starts.

    ConfigError where the budget cannot work: a shard larger than it, or a source that ``window_order=
    epoch`` reads all at once larger than it (nearly every sample would download a whole shard for one
    window)."""
    cache = remote_cache(splits, cache_dir, cache_max_gb, remote_cache_dir)
    if cache is None:
        return None
    remote = [any(is_url(x) for x in sp.shards) for sp in splits]
    whole = [r and reads_whole_epoch(sched) for r, sched in zip(remote, schedules)]
    needs = [[cache.need(e) for e in sp.entries] if r else [] for sp, r in zip(splits, remote)]
    budget, total = cache.max_bytes, sum(map(sum, needs))
    whole_need = sum(sum(n) for n, w in zip(needs, whole) if w)
    if budget and whole_need > budget:
        names = ", ".join(sp.path for sp, w in zip(splits, whole) if w)
        raise ConfigError(
            f"window_order=epoch reads every shard of remote source(s) {names} throughout an epoch "
            f"({whole_need / 1e9:.3g} GB with indexes): {cache.budget_text()} cannot hold them, so nearly "
            "every sample would download a whole shard for one window. Raise data.cache_max_gb above that "
            "(each node stages the source once per job), or start the run with data.window_order=keyed (a "
            "few shards at a time, re-downloaded each epoch)"
        )
    fits_all = not budget or total <= budget
    n_shards = [len(sp.shards) for sp in splits]
    if fits_all:
        remote_open = sum(n for n, r in zip(n_shards, remote) if r)
    else:
        remote_open = sum(n if w else REMOTE_OPEN for n, r, w in zip(n_shards, remote, whole) if r)
    return RemotePlan(
        cache=cache,
        remote_open=remote_open,
        depth=[n - 1 if w else PREFETCH_SHARDS for n, w in zip(n_shards, whole)],
        whole=whole,
        allowance=None if fits_all else budget,
        close_passed=not fits_all,
    )


def open_files(plan: RemotePlan | None, cache_dir) -> ShardFiles:
    """The shard files of one process (a rank, or one of its DataLoader workers)."""
    if plan is None:
        return ShardFiles(cache_dir)
    return ShardFiles(cache_dir, plan.cache, plan.remote_open)


class ShardPrefetch:
    """Stages the next remote shards of one process's sample stream in a background thread.

    The process reads micro-batches ``first, first + stride, ...`` (``samples_of(k)``: the global samples
    of micro-batch k); the thread walks that sequence ahead of the reader (each micro-batch once, at most
    ``HORIZON`` samples ahead), lists the remote shards in the order the stream first reads them, and holds
    a soft pin (`RemotePin`) on the first ``depth + 1`` of each source: the one being read and the next
    ``depth``, fetched in that order while the budget has room (a prefetcher evicts only unpinned
    copies; a reader that needs room for a shard nobody prefetched evicts prefetched ones before it
    waits, so prefetching never starves a reader). A shard the stream has passed (no
    micro-batch from the reader's position up to the walk reads it) loses its pin and, when the budget
    cannot hold every shard, is closed by the reader at its next ``advance``, so the cache can evict it.

    Why: a download inside the loader stalls the step for as long as it takes, at every new shard; ahead
    of the reader it overlaps training. A download error here is only logged: the reader meets it itself,
    under ``data.on_error``. The thread walks its own copies of the schedules and the mixture, whose
    lookups keep state."""

    HORIZON = 1 << 17  # samples walked ahead of the reader at most

    def __init__(
        self,
        plan: RemotePlan,
        files: ShardFiles,
        splits: Sequence[SourceSplit],
        schedules: Sequence,
        mixture,
        samples_of: Callable[[int], list[int]],
        first: int,
        stride: int,
    ):
        self.plan, self.files, self.cache = plan, files, plan.cache
        self.splits = list(splits)
        self.fetched = 0  # shards this prefetcher pinned (downloaded, or found staged)
        self._schedules = copy.deepcopy(list(schedules))
        self._mixture = copy.deepcopy(mixture)
        self._samples_of = samples_of
        self._first, self._stride = first, stride
        self._horizon = max(1, self.HORIZON // max(1, len(samples_of(first)))) * stride
        self._remote = [any(is_url(x) for x in split.shards) for split in self.splits]
        self._orders: dict[int, dict] = {}
        self._pos = self._wake_at = first
        self._wake = threading.Event()
        self._stop = False
        self._done: deque[str] = deque()  # shards the stream has passed, for the reader to close
        self._pins: dict[str, RemotePin] = {}
        self._failed: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="goat-dist-shard-prefetch", daemon=True)
        self._thread.start()

    def advance(self, k: int) -> None:
        """The reader is about to read micro-batch `k`: close the shards the stream has passed, wake the
        thread when that frees a shard."""
        self._pos = k
        closed = bool(self._done)
        while self._done:
            self.files.release(self._done.popleft())
        if closed or k >= self._wake_at:  # a closed shard can make room for the next fetch
            self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=1.0)  # a download under way finishes on its own; the thread then ends

    def _shards_of(self, n: int) -> list[tuple[str, int, dict]]:
        s, j = self._mixture.locate(n)
        if not self._remote[s]:
            return []
        split = self.splits[s]
        orders = self._orders.setdefault(s, {})
        out = []
        for i in shard_sequence(split, self._schedules[s], orders, j):
            if is_url(split.shards[i]):
                out.append((split.shards[i], s, split.entries[i] if split.entries else {}))
        return out

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exn:  # the reader fetches what it needs itself
            log.warning("remote shard prefetch stopped: %s", exn)
        finally:
            for pin in self._pins.values():
                pin.release()
            self._pins.clear()

    def _walk(self, until: int, seen: OrderedDict, meta: dict, count: Counter, full: bool) -> None:
        """Walk micro-batches up to `until` (or, with `full`, until every remote source has `depth + 1`
        shards listed), recording for each shard the last micro-batch walked that reads it."""
        depth = self.plan.depth
        while self._cursor < until and not self._stop:
            if full and all(count[s] > depth[s] for s, r in enumerate(self._remote) if r):
                return
            for n in self._samples_of(self._cursor):
                for loc, s, entry in self._shards_of(n):
                    if loc not in seen:
                        count[s] += 1
                        meta[loc] = (s, entry)
                    seen[loc] = self._cursor  # keeps its place: the order is first use
            self._cursor += self._stride

    def _loop(self) -> None:
        seen: OrderedDict[str, int] = OrderedDict()  # shard -> last micro-batch walked that reads it
        meta: dict[str, tuple[int, dict]] = {}
        count: Counter = Counter()  # listed shards per source
        self._cursor = self._first
        while not self._stop:
            self._wake.clear()
            pos = self._pos
            self._cursor = max(self._cursor, pos)
            self._walk(pos + self._stride, seen, meta, count, full=False)  # the reader's own micro-batch
            for loc, last in list(seen.items()):
                s = meta[loc][0]
                if last < pos and not self.plan.whole[s]:  # passed: nothing from here up to the walk reads it
                    del seen[loc], meta[loc]
                    count[s] -= 1
                    pin = self._pins.pop(loc, None)
                    if pin is not None:
                        pin.release()
                    if self.plan.close_passed:
                        self._done.append(loc)
            self._walk(pos + self._horizon, seen, meta, count, full=True)
            blocked = self._fetch(seen, meta)
            self._wake_at = min(seen.values(), default=pos) + 1
            self._wake.wait(0.2 if blocked else 1.0)

    def _fetch(self, seen: OrderedDict, meta: dict) -> bool:
        """Pin the first `depth + 1` listed shards of each source, in stream order, within the allowance;
        True when the cache had no room for the next one."""
        taken: Counter = Counter()
        total = 0
        for loc in list(seen):
            s, entry = meta[loc]
            if taken[s] > self.plan.depth[s] or self._stop:
                continue
            taken[s] += 1
            need = self.cache.need(entry)
            allowance = self.plan.allowance
            if allowance is not None and total and total + need > allowance:
                return False
            total += need
            if loc in self._pins or loc in self._failed:
                continue
            try:
                pin = self.cache.acquire(loc, entry, soft=True)
            except Exception as exn:  # the reader meets it again, under data.on_error
                self._failed.add(loc)
                log.debug("prefetch of remote shard %s failed: %s", loc, exn)
                continue
            if pin is None:
                return True
            self._pins[loc] = pin
            self.fetched += 1
        return False


class NoPrefetch:
    """The prefetcher of a stream without remote shards."""

    fetched = 0

    def advance(self, k: int) -> None:
        pass

    def close(self) -> None:
        pass


def start_prefetch(
    plan: RemotePlan | None, files: ShardFiles, splits, schedules, mixture, samples_of, first, stride
):
    """A `ShardPrefetch` where the loader has remote sources, else a no-op with the same methods."""
    if plan is None:
        return NoPrefetch()
    return ShardPrefetch(plan, files, splits, schedules, mixture, samples_of, first, stride)
