"""Random access into shards: a shard's index, its open file, and remote shards staged to local disk.

Why: a rank of a large data-parallel job trains on 1/dp of the sample stream. Reading a window of
tokens by offset (one ``pread`` per document it touches, found by binary search in the shard's index)
makes its bytes read scale with its own share instead of with the corpus (a tar stream would have to be
decoded from the start of the shard to find them).

Where an index comes from:
  * prepared data sets list it in the manifest ("index": name, bytes, sha256; written by
    ``data_tools.writer``); it is memory-mapped (a lookup reads the pages its binary search touches,
    shared through the node's page cache) and checked at open against the manifest's size, the shard's
    size and token count (`goat-dist data inspect` checks its sha256 and every row);
  * shards made before the index existed get one built by a header scan on first open
    (``shard_format.scan_index``: 512 bytes per document), cached in
    ``<cache_dir>/shard-index/`` under the shard's path, size and mtime, so a replaced shard is scanned
    again;
  * remote shards (``pipe:``/URL sources, which cannot seek) are staged: copied into the host's remote
    cache (`RemoteCache`; one process per host downloads, the others wait on a file lock; the copy is
    checked against the manifest's size and sha256) and scanned there once, the index written beside
    the copy. Every guarantee of the sample stream holds unchanged.

The staged copies of remote shards and their budget live in ``remote_cache``.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from data_tools.shard_format import FIELDS, ShardError, check_index, ids_field, index_bytes, scan_index
from goat_dist.atomic import atomic_write_bytes
from goat_dist.data.remote_cache import (  # noqa: F401  (re-exported: readers and tests use them here)
    DEFAULT_CACHE_MAX_GB,
    PREFETCH_SHARDS,
    RECORD_NAME,
    REMOTE_OPEN,
    REMOTE_STATS,
    RemoteCache,
    RemotePin,
    _cache_key,
    remote_cache,
    remote_cache_root,
    stage_remote,
)
from goat_dist.data.shards import is_url

log = logging.getLogger("goat_dist.data")
OPEN_SHARDS = 32  # shards a process keeps open (file + index) at once; the stream touches a few at a time


def _load_listed_index(path: Path, listed: dict, size: int, n_tokens: int) -> np.ndarray:
    """The index a prepared data set lists beside the shard, memory-mapped: a lookup reads only the pages
    its binary search touches (served by the node's page cache to every process of the node), not the
    whole index. Checked at open against the manifest's size for the file and the shard's size and token
    count in its last row; its sha256 and every row are checked by `goat-dist data inspect`, as the
    shards' own checksums are."""
    where = path.parent / listed["name"]
    try:
        actual = where.stat().st_size
        if "bytes" in listed and actual != listed["bytes"]:
            raise ShardError(f"shard index {where} has {actual} bytes, the manifest lists {listed['bytes']}")
        index = np.load(where, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exn:
        raise ShardError(f"shard index {where} (listed in the manifest) cannot be read: {exn}") from exn
    return check_index(index, str(where), size, n_tokens, rows=False)


def _scanned_index(path: Path, n_tokens: int, cache_dir: Path | None):
    """(index, error) of a shard without a listed index: the cached scan, or a new scan, cached."""
    stat = path.stat()
    cached = None
    if cache_dir is not None:
        name = f"{_cache_key(str(path.resolve()))}-{stat.st_size}-{stat.st_mtime_ns}.idx.npy"
        cached = cache_dir / "shard-index" / name
        try:
            return check_index(np.load(cached, allow_pickle=False), str(cached), stat.st_size, n_tokens), None
        except (OSError, ValueError, ShardError):
            pass
    index, error = scan_index(path)
    if error is None and int(index[-1, 1]) != n_tokens:
        error = ShardError(
            f"shard {path} holds {int(index[-1, 1])} tokens, the manifest lists {n_tokens} "
            "(truncated at a document boundary?)"
        )
    if error is None and cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cached, index_bytes(index))
        except OSError as exn:  # a read-only cache costs a scan per open, nothing else
            log.warning("cannot cache the index of %s in %s: %s", path, cached, exn)
    return index, error


def _staged_index(path: Path, n_tokens: int) -> np.ndarray | None:
    """The index the remote cache wrote beside a staged shard (None: absent or not for this shard, so the
    reader scans). Loaded whole (16 bytes per document): a memory map would keep an evicted copy's disk
    space in use for as long as the process lives."""
    try:
        return check_index(np.load(path, allow_pickle=False), str(path), None, n_tokens)
    except (OSError, ValueError, ShardError):
        return None


def _member_key(fd: int, data_offset: int) -> str | None:
    """The sample key of the tar member whose data starts at `data_offset` (for error messages)."""
    try:
        header = os.pread(fd, 512, data_offset - 512)
        name = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape").name
    except (OSError, tarfile.TarError, ValueError):
        return None
    return name.rsplit("/", 1)[-1].split(".")[0]


class ShardFile:
    """One shard open for random access: ``read(a, b)`` returns tokens [a, b) of the shard.

    A damaged shard (missing, shorter than the manifest says, an index that does not check, token ids
    outside the vocabulary) has ``error`` set, a ShardError naming the shard and where possible the
    sample; ``readable_until`` is then how many of its tokens can still be read, so that
    ``on_error=skip`` marks only the rest as missing."""

    def __init__(
        self,
        location: str,
        entry: dict,
        n_tokens: int,
        vocab_size: int,
        cache_dir: Path | None,
        remote: RemoteCache | None = None,
        on_wait=None,
    ):
        self.location = location
        self.dtype = FIELDS[ids_field(vocab_size)]
        self.vocab_size = vocab_size
        self.n_tokens = n_tokens
        self.fd: int | None = None
        self.pin: RemotePin | None = None  # a remote shard's staged copy, pinned while open
        self.error: ShardError | None = None
        self.readable_until = 0
        self.index = np.zeros((1, 2), dtype=np.int64)
        if remote is None and cache_dir is not None:
            remote = RemoteCache(cache_dir / "remote")
        try:
            self._open(entry, cache_dir, remote, on_wait)
            self.readable_until = n_tokens
        except ShardError as exn:
            self.error = exn
        except OSError as exn:
            self.error = ShardError(f"cannot open shard {location}: {exn}")

    def _open(self, entry: dict, cache_dir: Path | None, remote: RemoteCache | None, on_wait) -> None:
        path = Path(self.location)
        staged = None
        if is_url(self.location):
            if remote is None:
                raise ShardError(f"remote shard {self.location}: no cache directory to stage it in")
            self.pin = remote.acquire(self.location, entry, on_wait=on_wait)
            path = self.pin.path
            staged = _staged_index(self.pin.index_path, self.n_tokens)
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        listed = entry.get("index")
        if listed and not is_url(self.location):
            self.index = _load_listed_index(path, listed, entry.get("bytes"), self.n_tokens)
        elif staged is not None:
            self.index = staged
        else:
            self.index, error = _scanned_index(path, self.n_tokens, cache_dir)
            if error is not None:
                self.readable_until = int(self.index[-1, 1])
                raise error
        expected = entry.get("bytes")
        if size == int(self.index[-1, 0]) and (expected is None or size == expected):
            return  # the shard the index describes: every document lies inside it (data inspect checks)
        n_docs = len(self.index) - 1
        ends = self.index[:-1, 0] + np.diff(self.index[:, 1]) * self.dtype.itemsize
        bad = int(np.searchsorted(ends > size, True))  # ends ascend: the flags are False..., True...
        self.readable_until = int(self.index[bad, 1])
        if bad < n_docs or (expected is not None and size != expected):
            key = _member_key(self.fd, int(self.index[bad, 0])) if bad < n_docs else None
            sample = f"; the first document past its end: sample {key!r}" if key else ""
            raise ShardError(
                f"shard {self.location} has {size} bytes, the manifest lists {expected}: "
                f"truncated or replaced?{sample}"
            )

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the shard, one pread per document touched; ShardError where it cannot."""
        if b > self.readable_until:
            raise self.error or ShardError(f"shard {self.location}: tokens [{a}, {b}) are past its end")
        out = np.empty(b - a, dtype=self.dtype)
        item = self.dtype.itemsize
        starts = self.index[:, 1]
        doc = int(np.searchsorted(starts, a, side="right")) - 1
        pos = a
        while pos < b:
            start, end = int(starts[doc]), int(starts[doc + 1])
            hi = min(b, end)
            want = (hi - pos) * item
            data = os.pread(self.fd, want, int(self.index[doc, 0]) + (pos - start) * item)
            if len(data) != want:
                key = _member_key(self.fd, int(self.index[doc, 0]))
                raise ShardError(f"shard {self.location}: sample {key!r} is cut short (truncated shard?)")
            out[pos - a : hi - a] = np.frombuffer(data, dtype=self.dtype)
            pos, doc = hi, doc + 1
        if out.size and int(out.max()) >= self.vocab_size:
            raise ShardError(
                f"shard {self.location}: token id {int(out.max())} >= vocab_size {self.vocab_size} "
                f"in tokens [{a}, {b}) (corrupt data?)"
            )
        return out

    def doc_starts(self, a: int, b: int) -> np.ndarray:
        """Shard-local first tokens of the documents holding tokens [a, b), ascending."""
        starts = self.index[:, 1]
        first = int(np.searchsorted(starts, a, side="right")) - 1
        last = int(np.searchsorted(starts, b, side="left"))
        return starts[first:last]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pin is not None:
            self.pin.release()
            self.pin = None


class ShardFiles:
    """The shards a process has open, least recently used closed first (``OPEN_SHARDS`` at most, of which
    ``remote_open`` remote ones: an open remote shard is pinned, and a pin the stream no longer needs
    would keep the cache from making room for the next shards)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike | None,
        remote: RemoteCache | None = None,
        remote_open: int = REMOTE_OPEN,
    ):
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.remote = (
            remote if remote is not None or self.cache_dir is None else RemoteCache(self.cache_dir / "remote")
        )
        self.remote_open = max(1, remote_open)
        self._open: OrderedDict[str, ShardFile] = OrderedDict()

    def get(self, location: str, entry: dict, n_tokens: int, vocab_size: int) -> ShardFile:
        shard = self._open.get(location)
        if shard is None:
            shard = ShardFile(location, entry, n_tokens, vocab_size, self.cache_dir, self.remote, self._unpin)
            self._open[location] = shard
            if shard.pin is not None and len(self._open) > self.remote_open:
                remote = [loc for loc, f in self._open.items() if f.pin is not None]
                for loc in remote[: max(0, len(remote) - self.remote_open)]:
                    self.release(loc)
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(location)
        return shard

    def _unpin(self) -> None:
        """Close every open remote shard: a read needs room the budget only has without their pins (the
        reader reads one shard at a time, so none of them is in use; they reopen when read again)."""
        for loc in [loc for loc, f in self._open.items() if f.pin is not None]:
            self.release(loc)

    def release(self, location: str) -> None:
        """Close `location` if open (the stream is done with it for now: its pin goes)."""
        shard = self._open.pop(location, None)
        if shard is not None:
            shard.close()

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()
