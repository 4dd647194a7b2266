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
  * remote shards (``pipe:``/URL sources, which cannot seek) are copied once into
    ``<cache_dir>/remote/`` (one process per host downloads, the others wait on a file lock; the copy is
    checked against the manifest's size and sha256), then indexed like a local shard. Every guarantee of
    the sample stream holds unchanged; the cost is local disk for the shards the run reaches.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from data_tools.shard_format import FIELDS, ShardError, check_index, ids_field, index_bytes, scan_index
from goat_dist.atomic import atomic_write_bytes, commit_file, temp_path_for
from goat_dist.data.shards import is_url, open_shard

log = logging.getLogger("goat_dist.data")

OPEN_SHARDS = 32  # shards a process keeps open (file + index) at once; the stream touches a few at a time


def _cache_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def stage_remote(url: str, entry: dict, cache_dir: Path) -> Path:
    """A local copy of remote shard `url` (downloaded once per host, checked against the manifest)."""
    dest = cache_dir / "remote" / _cache_key(url) / entry["name"]
    if dest.is_file() and dest.stat().st_size == entry.get("bytes", dest.stat().st_size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per host; the others find it done
        if dest.is_file() and dest.stat().st_size == entry.get("bytes", dest.stat().st_size):
            return dest
        tmp = temp_path_for(dest)
        digest, size = hashlib.sha256(), 0
        try:
            src = open_shard(url)
            try:
                with open(tmp, "wb") as out:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
            finally:
                src.close()
            if "bytes" in entry and size != entry["bytes"]:
                raise ShardError(f"remote shard {url}: got {size} bytes, the manifest lists {entry['bytes']}")
            if "sha256" in entry and digest.hexdigest() != entry["sha256"]:
                raise ShardError(f"remote shard {url} does not match the manifest's sha256")
            commit_file(tmp, dest)
        except BaseException as exn:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exn, ShardError):
                raise
            if isinstance(exn, Exception):
                raise ShardError(f"cannot copy remote shard {url}: {exn}") from exn
            raise
    log.info("staged remote shard %s (%d bytes) at %s", url, size, dest)
    return dest


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

    def __init__(self, location: str, entry: dict, n_tokens: int, vocab_size: int, cache_dir: Path | None):
        self.location = location
        self.dtype = FIELDS[ids_field(vocab_size)]
        self.vocab_size = vocab_size
        self.n_tokens = n_tokens
        self.fd: int | None = None
        self.error: ShardError | None = None
        self.readable_until = 0
        self.index = np.zeros((1, 2), dtype=np.int64)
        try:
            self._open(entry, cache_dir)
            self.readable_until = n_tokens
        except ShardError as exn:
            self.error = exn
        except OSError as exn:
            self.error = ShardError(f"cannot open shard {location}: {exn}")

    def _open(self, entry: dict, cache_dir: Path | None) -> None:
        path = Path(self.location)
        if is_url(self.location):
            if cache_dir is None:
                raise ShardError(f"remote shard {self.location}: no cache directory to stage it in")
            path = stage_remote(self.location, entry, cache_dir)
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        listed = entry.get("index")
        if listed and not is_url(self.location):
            self.index = _load_listed_index(path, listed, entry.get("bytes"), self.n_tokens)
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


class ShardFiles:
    """The shards a process has open, least recently used closed first (``OPEN_SHARDS`` at most)."""

    def __init__(self, cache_dir: str | os.PathLike | None):
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self._open: OrderedDict[str, ShardFile] = OrderedDict()

    def get(self, location: str, entry: dict, n_tokens: int, vocab_size: int) -> ShardFile:
        shard = self._open.get(location)
        if shard is None:
            shard = ShardFile(location, entry, n_tokens, vocab_size, self.cache_dir)
            self._open[location] = shard
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(location)
        return shard

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()
