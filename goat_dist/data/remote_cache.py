"""The host's cache of remote shards: staged copies within ``data.cache_max_gb``, pinned while read.

Remote shards (``pipe:``/URL sources, which cannot seek) are copied into the host's remote cache
(`RemoteCache`; one process per host downloads, the others wait on a file lock; the copy is checked
against the manifest's size and sha256) and scanned there once, the index written beside the copy.

The cache (`remote_cache_root`: node-local scratch inside a Slurm job, else ``<cache_dir>/remote``) keeps
at most ``data.cache_max_gb``: least recently used copies are evicted, never one a reader of the host has
open (`RemotePin`: a shared flock, which the kernel drops with its holder), and only copies its own record
lists. Why: at large dp every rank reads a little of every shard, so every node stages every shard its
stream reaches; unbounded, that is the corpus on every node's disk. ``shard_index`` reads the copies.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from data_tools.shard_format import ShardError, index_bytes, scan_index
from goat_dist.atomic import atomic_write_bytes, commit_file, temp_path_for
from goat_dist.config import ConfigError
from goat_dist.data.shards import is_url, open_shard

log = logging.getLogger("goat_dist.data")


REMOTE_OPEN = 4  # remote shards a process keeps open (and so pinned) per remote source
PREFETCH_SHARDS = 2  # remote shards fetched ahead of the one being read, per source, within the budget
# data.cache_max_gb's default. Why 50: under window_order=keyed a run's working set is a few shards per
# source (64 MB each by default), so 50 GB is hundreds of times that; under window_order=epoch a remote
# source must fit whole (a larger one is refused at start, naming the fix), and 50 GB holds a sizeable
# one. It stays well inside the node-local scratch of a GPU node (typically >= 500 GB of NVMe) and bounds
# what a forgotten default can fill there (or, outside Slurm, in ~/.cache).
DEFAULT_CACHE_MAX_GB = 50.0
SPACE_WAIT_S = 600.0  # a reader waits this long for room while every staged shard is pinned
RECORD_NAME = "goat-dist-remote-cache.json"
RECORD_FORMAT = "goat-dist-remote-cache/1"
COUNTERS = ("downloads", "downloaded_bytes", "evictions", "waits")  # host-wide, in the record
# this process's: reader waits on a fetch (and their seconds), downloads, evictions (read by tests)
REMOTE_STATS = {"waits": 0, "wait_s": 0.0, "downloads": 0, "downloaded_bytes": 0, "evictions": 0}


def _cache_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:20]


class RemotePin:
    """A staged remote shard held by this process: while held, no process of the host evicts it.

    The pin is a shared ``flock`` on a per-shard lock file: the kernel drops it when its holder exits or
    dies, so a crashed reader never leaves a shard pinned (a counter in a file would). A *hard* pin (a
    reader has the shard open) is never evicted; a *soft* pin (prefetched for the stream's next shards)
    is evicted only by a reader that needs the room for the shard it reads now."""

    def __init__(self, location: str, path: Path, fd: int | None):
        self.location, self.path, self._fd = location, path, fd

    @property
    def index_path(self) -> Path:
        return _sidecar(self.path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops its flock
            self._fd = None


def _sidecar(dest: Path) -> Path:
    """The header-scan index the cache writes beside a staged shard (evicted with it)."""
    return dest.with_name(dest.name + ".index.npy")


def _lock_path(dest: Path, kind: str) -> Path:
    """Per-shard lock files, never deleted (a lock on a deleted file guards nothing): ``pin`` (readers,
    shared), ``soft`` (prefetchers, shared) and the download lock (``<name>.lock``, exclusive)."""
    return (
        dest.with_name(dest.name + ".lock") if kind == "download" else dest.with_name(f".{dest.name}.{kind}")
    )


def _flock(path: Path, how: int) -> int | None:
    """An open descriptor of `path` holding `how`; None where a non-blocking lock is taken by someone."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _locked(path: Path, how: int = fcntl.LOCK_EX):
    fd = _flock(path, how)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def remote_cache_root(cache_dir, remote_cache_dir=None, env=None) -> Path:
    """Where remote shards are staged: ``data.remote_cache_dir`` when set; inside a Slurm job, node-local
    scratch (``$SLURM_TMPDIR``, else ``$TMPDIR``: per-job directories on the compute node, which
    ``slurm/train.sbatch`` points at ``$GOAT_SCRATCH``); else ``<data.cache_dir>/remote``.

    Why: every node stages the shards its ranks read (at large dp, all of them), so the copies belong on
    the node's own disk: ``~/.cache`` is often an NFS home, shared by all nodes and small. A per-job
    scratch directory is emptied with the job, so a job re-downloads what it reads: the budget
    (``data.cache_max_gb``), not the scratch's lifetime, is what bounds the disk a run takes."""
    if remote_cache_dir:
        return Path(remote_cache_dir).expanduser()
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        for var in ("SLURM_TMPDIR", "TMPDIR"):
            scratch = env.get(var)
            if scratch and os.path.isdir(scratch) and os.access(scratch, os.W_OK | os.X_OK):
                return Path(scratch) / f"goat-dist-remote-{os.getuid()}"
    return Path(cache_dir).expanduser() / "remote"


def index_allowance(entry: dict) -> int:
    """Bytes of the index the cache writes beside a shard: 16 per document plus the .npy header; without
    the manifest's document count, a bound (a tar member takes at least 1,024 bytes)."""
    docs = entry.get("n_docs")
    if not isinstance(docs, int):
        docs = int(entry.get("bytes", 0)) // 1024
    return 16 * (docs + 1) + 128


class RemoteCache:
    """Remote shards staged on this host's disk, least recently used evicted first within `max_bytes`.

    Layout under ``root``: ``<sha1(url)[:20]>/<name>`` (the shard), ``<name>.index.npy`` (its header scan,
    written by the downloader so that no reader scans it again), and the record
    ``goat-dist-remote-cache.json``: every staged shard with its bytes (shard + index), the shards being
    downloaded (their bytes reserved before the download starts, so a download never takes the cache over
    its budget), and host-wide counters (downloads, downloaded bytes, evictions, downloads a reader waited
    for: the node's egress and how often a step stalled on it). The record
    is rewritten atomically under the lock file ``.record.lock``; a shard is evicted only if the record
    lists it (the cache deletes nothing it did not write; a copy found at its place by an older version is
    recorded when first used), and only while no reader pins it (``RemotePin``). Least recently used is
    the mtime of the shard's pin file, touched at every pin.

    Why a budget: at large dp every rank reads a little of every shard, so every node stages the whole
    corpus; without one, the cache fills the disk. ``max_bytes=None``: no limit, nothing is evicted (the
    cache as it was before the budget existed)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes) if max_bytes else None

    def __repr__(self) -> str:
        budget = f"{self.max_bytes / 1e9:g} GB" if self.max_bytes else "no limit"
        return f"RemoteCache({str(self.root)!r}, {budget})"

    def budget_text(self) -> str:
        return f"data.cache_max_gb={self.max_bytes / 1e9:g} (remote cache {self.root})"

    # ---------------------------------------------------------------- where things are

    def place(self, url: str, entry: dict) -> tuple[str, Path]:
        """(record key, path) of the staged copy of `url`."""
        name = entry.get("name") or url.rsplit("/", 1)[-1]
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ShardError(f"remote shard {url}: {name!r} is not a plain file name")
        key = _cache_key(url)
        return f"{key}/{name}", self.root / key / name

    def need(self, entry: dict) -> int:
        """Bytes a shard takes in the cache (shard + index); 0 where the manifest does not say."""
        return int(entry["bytes"]) + index_allowance(entry) if "bytes" in entry else 0

    def check_fits(self, url: str, need: int) -> None:
        if self.max_bytes and need > self.max_bytes:
            raise ConfigError(
                f"remote shard {url} takes {need / 1e9:.3g} GB in the cache (with its index), more than "
                f"the whole budget {self.budget_text()}; raise data.cache_max_gb (0: no limit)"
            )

    # ---------------------------------------------------------------- the record

    def _record_path(self) -> Path:
        return self.root / RECORD_NAME

    def record(self) -> dict:
        """The record as last written (atomic replace: a read without the lock is never torn)."""
        try:
            rec = json.loads(self._record_path().read_text())
        except FileNotFoundError:
            rec = {}
        except (OSError, ValueError) as exn:  # nothing listed is evicted: the safe side
            log.warning(
                "remote cache record %s unreadable (%s): starting a new one", self._record_path(), exn
            )
            rec = {}
        if rec.get("format") != RECORD_FORMAT or not isinstance(rec.get("entries"), dict):
            rec = {"format": RECORD_FORMAT, "entries": {}}
        for counter in COUNTERS:
            rec.setdefault(counter, 0)
        return rec

    def _save(self, rec: dict) -> None:
        """Atomic (a reader sees the old record or the new one) but not synced: it is rewritten at every
        download, and a record lost with the machine only leaves copies unrecorded (adopted when used)."""
        tmp = temp_path_for(self._record_path())
        try:
            tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
            os.replace(tmp, self._record_path())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @contextmanager
    def _record_locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / ".record.lock"):
            yield self.record()

    def usage(self) -> int:
        """Bytes the record holds (staged + reserved)."""
        return sum(int(e["bytes"]) for e in self.record()["entries"].values())

    # ---------------------------------------------------------------- pin, stage, evict

    def _ready(self, dest: Path, entry: dict) -> bool:
        try:
            size = dest.stat().st_size
        except FileNotFoundError:
            return False
        return size == entry.get("bytes", size)

    def _note(self, url: str, rel: str, dest: Path) -> None:
        """Record a ready copy the record does not list (staged by a version before the record existed)."""
        if rel in self.record()["entries"]:
            return
        with self._record_locked() as rec:
            if rel not in rec["entries"]:
                side = _sidecar(dest)
                size = dest.stat().st_size + (side.stat().st_size if side.is_file() else 0)
                rec["entries"][rel] = {"bytes": size, "url": url}
                self._save(rec)

    def acquire(self, url: str, entry: dict, soft: bool = False, on_wait=None) -> RemotePin | None:
        """Pin the staged copy of `url`, downloading it first if needed (one download per host: the other
        processes wait on its lock and find it done).

        A reader (``soft=False``) waits for room while every staged shard is pinned, and raises
        ConfigError after ``SPACE_WAIT_S`` (the budget cannot hold the shards this host's readers have
        open; ``on_wait()`` is called first, for the reader to close the copies it holds but does not
        need now); a prefetcher (``soft=True``) evicts only unpinned shards and returns None at once when
        that does not make room (it tries again later)."""
        rel, dest = self.place(url, entry)
        need = self.need(entry)
        self.check_fits(url, need)
        dest.parent.mkdir(parents=True, exist_ok=True)
        pin_file = _lock_path(dest, "pin")
        pin = RemotePin(url, dest, _flock(_lock_path(dest, "soft") if soft else pin_file, fcntl.LOCK_SH))
        t0 = time.monotonic()
        waited = False
        try:
            _touch(pin_file)  # least recently used = oldest pin
            if self._ready(dest, entry):
                self._note(url, rel, dest)
                return pin
            if not soft:
                waited = True
                REMOTE_STATS["waits"] += 1
            with _locked(_lock_path(dest, "download")):
                if self._ready(dest, entry):  # another process of the host downloaded it meanwhile
                    self._note(url, rel, dest)
                    return pin
                if not self._reserve_or_wait(url, rel, need, soft, on_wait):
                    pin.release()
                    return None
                try:
                    shard_bytes, total = self._download(url, entry, dest)
                except BaseException:
                    self._drop(rel)
                    raise
                self._commit(url, rel, shard_bytes, total, waited)
            return pin
        except BaseException:
            pin.release()
            raise
        finally:
            if waited:
                REMOTE_STATS["wait_s"] += time.monotonic() - t0

    def _reserve_or_wait(self, url: str, rel: str, need: int, soft: bool, on_wait=None) -> bool:
        deadline, delay = time.monotonic() + SPACE_WAIT_S, 0.05
        while not self._reserve(url, rel, need, soft):
            if soft:
                return False
            if on_wait is not None:
                on_wait()
                on_wait = None
                continue
            if time.monotonic() > deadline:
                held = len(self.record()["entries"])
                raise ConfigError(
                    f"remote shard {url} ({need / 1e9:.3g} GB) found no room in {SPACE_WAIT_S:g} s: the "
                    f"{held} shards in the cache are all held open by readers of this host, and "
                    f"{self.budget_text()} holds no more; raise data.cache_max_gb (0: no limit)"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 2)
        return True

    def _last_used(self, rel: str) -> float:
        dest = self.root / rel
        for path in (_lock_path(dest, "pin"), dest):
            try:
                return path.stat().st_mtime
            except OSError:
                pass
        return 0.0

    def _reserve(self, url: str, rel: str, need: int, soft: bool) -> bool:
        """Record `need` bytes for `rel` (being downloaded), evicting least recently used shards to make
        room; False where even that leaves no room. The caller holds `rel`'s download lock."""
        with self._record_locked() as rec:
            entries = rec["entries"]
            entries.pop(rel, None)  # a stale line of this very shard: its lock is ours now
            for other, e in list(entries.items()):
                if e.get("pending") and self._evict(other, soft=True):  # its downloader died
                    del entries[other]
                elif not e.get("pending") and not (self.root / other).is_file():
                    del entries[other]  # removed by hand: nothing to account for
            used = sum(int(e["bytes"]) for e in entries.values())
            if self.max_bytes and used + need > self.max_bytes:
                used = self._make_room(rec, used, need, soft)
            fits = not self.max_bytes or used + need <= self.max_bytes
            if fits:
                entries[rel] = {"bytes": need, "url": url, "pending": True}
            self._save(rec)
            return fits

    def _make_room(self, rec: dict, used: int, need: int, soft: bool) -> int:
        entries = rec["entries"]
        by_age = sorted((r for r, e in entries.items() if not e.get("pending")), key=self._last_used)
        for respect_soft in (True,) if soft else (True, False):  # unpinned first, then prefetched ones
            for other in by_age:
                if used + need <= self.max_bytes:
                    return used
                if other in entries and self._evict(other, respect_soft):
                    used -= int(entries.pop(other)["bytes"])
                    rec["evictions"] += 1
                    REMOTE_STATS["evictions"] += 1
                    log.debug("evicted remote shard %s from %s", other, self.root)
        return used

    def _evict(self, rel: str, soft: bool) -> bool:
        """Delete a recorded shard (its copy, index and temporary files) if no reader pins it, nobody is
        downloading it and (with `soft`) no prefetcher holds it; True when it was deleted."""
        dest = self.root / rel
        kinds = ("pin", "download", "soft") if soft else ("pin", "download")
        fds: list[int] = []
        try:
            if not dest.parent.is_dir():
                return True  # removed by hand: nothing left to delete
            for kind in kinds:
                fd = _flock(_lock_path(dest, kind), fcntl.LOCK_EX | fcntl.LOCK_NB)
                if fd is None:
                    return False
                fds.append(fd)
            for path in (dest, _sidecar(dest), *dest.parent.glob(f".{glob.escape(dest.name)}.*.tmp")):
                path.unlink(missing_ok=True)
            return True
        finally:
            for fd in fds:
                os.close(fd)

    def _drop(self, rel: str) -> None:
        with self._record_locked() as rec:
            if rec["entries"].pop(rel, None) is not None:
                self._save(rec)

    def _commit(self, url: str, rel: str, shard_bytes: int, total: int, waited: bool) -> None:
        with self._record_locked() as rec:
            rec["entries"][rel] = {"bytes": total, "url": url}
            rec["downloads"] += 1
            rec["downloaded_bytes"] += shard_bytes
            rec["waits"] += int(waited)
            used = sum(int(e["bytes"]) for e in rec["entries"].values())
            if self.max_bytes and used > self.max_bytes:  # a shard whose size the manifest did not give
                self._make_room(rec, used - total, total, soft=False)
            self._save(rec)
        REMOTE_STATS["downloads"] += 1
        REMOTE_STATS["downloaded_bytes"] += shard_bytes

    def _download(self, url: str, entry: dict, dest: Path) -> tuple[int, int]:
        """Copy `url` to `dest` (checked against the manifest's size and sha256) with its header-scan index
        beside it; (shard bytes, shard + index bytes)."""
        tmp = temp_path_for(dest)
        digest, size = hashlib.sha256(), 0
        side = _sidecar(dest)
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
            index, error = scan_index(tmp)
            if error is None and int(index[-1, 1]) == entry.get("n_tokens", int(index[-1, 1])):
                atomic_write_bytes(side, index_bytes(index))
            else:  # the reader scans it again and names what is wrong, under its own name
                side.unlink(missing_ok=True)
            commit_file(tmp, dest)
        except BaseException as exn:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exn, ShardError):
                raise
            if isinstance(exn, Exception):
                raise ShardError(f"cannot copy remote shard {url}: {exn}") from exn
            raise
        log.info("staged remote shard %s (%d bytes) at %s", url, size, dest)
        return size, size + (side.stat().st_size if side.is_file() else 0)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:
        pass


def remote_cache(splits, cache_dir, cache_max_gb=None, remote_cache_dir=None) -> RemoteCache | None:
    """The remote cache of a loader's sources (None when none is remote or there is no cache dir), checked
    now: a shard larger than the whole budget is a ConfigError naming it, before any worker starts."""
    remote = [
        (s, split.entries[i] if split.entries else {})
        for split in splits
        for i, s in enumerate(split.shards)
        if is_url(s)
    ]
    if not remote:
        return None
    if cache_dir is None and not remote_cache_dir:
        return None  # each remote shard then fails to open, naming the missing cache directory
    if cache_max_gb is not None and not cache_max_gb >= 0:
        raise ConfigError(f"data.cache_max_gb must be >= 0 (0: no limit), got {cache_max_gb}")
    budget = int(cache_max_gb * 1e9) if cache_max_gb else None
    cache = RemoteCache(remote_cache_root(cache_dir, remote_cache_dir), budget)
    needs = [(cache.need(e), s) for s, e in remote]
    largest = max(needs, default=(0, ""))
    cache.check_fits(largest[1], largest[0])
    total = sum(n for n, _ in needs)
    if budget and largest[0] and total > budget and budget < (PREFETCH_SHARDS + 1) * largest[0]:
        log.warning(
            "%s holds %d shards of up to %.3g GB: fewer than the %d that reading one while %d are "
            "prefetched takes; steps will wait on downloads",
            cache.budget_text(),
            budget // largest[0],
            largest[0] / 1e9,
            PREFETCH_SHARDS + 1,
            PREFETCH_SHARDS,
        )
    return cache


def stage_remote(url: str, entry: dict, cache_dir: Path) -> Path:
    """A local copy of remote shard `url` in ``<cache_dir>/remote`` (no budget; not pinned)."""
    pin = RemoteCache(Path(cache_dir) / "remote").acquire(url, entry)
    pin.release()
    return pin.path
