"""On-disk format of tokenized documents: webdataset tar shards plus a JSON manifest.

Why: tar shards stream sequentially from local disks, NFS or object stores, are easy to produce
in parallel (one writer per shard) and need no index. The manifest pins the token dtype, the
tokenizer and a checksum per shard, so a trainer can check what it reads.

Format `goat-dist-shards/1`:
  * one webdataset sample per document: member `<key>.ids.u16` (vocab_size <= 65535) or
    `<key>.ids.u32`, holding the token ids as raw little-endian integers, EOS already appended;
    keys contain no '.' or '/' (webdataset splits the member name at the first dot);
  * shards `<prefix>-000000.tar`, `<prefix>-000001.tar`, ... written under a temporary name and
    renamed into place only when complete; byte-for-byte reproducible (fixed mtime/owner);
  * `manifest.json`: {"format", "vocab_size", "dtype", "tokenizer_sha256",
    "splits": {split: [{"name", "n_docs", "n_tokens", "bytes", "sha256"}, ...]}, ...extra keys}.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

import numpy as np
from webdataset import tariterators
from webdataset.gopen import gopen
from webdataset.writer import TarWriter

from goat_dist.atomic import atomic_write_text, commit_file, sha256_file, temp_path_for

FORMAT = "goat-dist-shards/1"
MANIFEST_NAME = "manifest.json"
# field name in the tar sample -> little-endian numpy dtype of the stored ids
FIELDS = {"ids.u16": np.dtype("<u2"), "ids.u32": np.dtype("<u4")}
DTYPE_NAMES = {"ids.u16": "uint16", "ids.u32": "uint32"}
_TAR_BLOCK = 512


class ShardError(RuntimeError):
    """A shard that can't be read or decoded; the message names the shard and the sample key."""


def ids_field(vocab_size: int) -> str:
    """Tar field used for a vocabulary: 16-bit ids when they fit, else 32-bit."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit 32-bit token ids")
    return "ids.u16" if vocab_size <= 65535 else "ids.u32"


def dtype_name(vocab_size: int) -> str:
    """Manifest `dtype` for a vocabulary size ("uint16" or "uint32")."""
    return DTYPE_NAMES[ids_field(vocab_size)]


class _HashingFile:
    """Write-only file wrapper that hashes and counts what goes through it (tar streams only write)."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.nbytes += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


class ShardWriter:
    """Writes documents into size-capped tar shards; use as a context manager.

    `write(key, ids)` appends one document; a shard is closed, fsynced and renamed into place
    once it reaches `shard_size_mb`. `close()` (or leaving the `with` block) finishes the last
    shard and returns `self.shards`, the manifest entries of all shards written. Leaving the block
    with an exception deletes the unfinished temporary shard.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        prefix: str = "train",
        shard_size_mb: float = 64,
        *,
        vocab_size: int,
        start_index: int = 0,
    ):
        if shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
        if not prefix or "/" in prefix:
            raise ValueError(f"invalid shard prefix {prefix!r}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_bytes = int(shard_size_mb * 1024 * 1024)
        self.vocab_size = vocab_size
        self.field = ids_field(vocab_size)
        self.dtype = FIELDS[self.field]
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        # a restarted writer continues the numbering of shards already finished by an earlier run
        self.start_index = start_index
        self.shards: list[dict] = []
        self._keys: set[str] = set()
        self._file = None
        self._closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key or "." in key or "/" in key or key.startswith("__"):
            raise ValueError(f"invalid document key {key!r}: need non-empty, no '.' or '/', no '__' prefix")
        if key in self._keys:
            raise ValueError(f"duplicate document key {key!r}")

    def write(self, key: str, ids) -> None:
        """Append one document (token ids, EOS included) under `key`."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        self._check_key(key)
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"document {key!r}: ids must be a non-empty 1-D sequence, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"document {key!r}: ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"document {key!r}: token id out of range [0, {self.vocab_size}): {lo}..{hi}")
        data = arr.astype(self.dtype, copy=False).tobytes()
        if self._file is None:
            self._open()
        self._tar.write({"__key__": key, self.field: data})
        self._keys.add(key)
        self._n_docs += 1
        self._n_tokens += arr.size
        # tar member = header block + data padded to whole blocks
        self._size += _TAR_BLOCK + -(-len(data) // _TAR_BLOCK) * _TAR_BLOCK
        if self._size >= self.max_bytes:
            self._finish()

    def _open(self) -> None:
        self._name = f"{self.prefix}-{self.start_index + len(self.shards):06d}.tar"
        self._tmp = temp_path_for(self.out_dir / self._name)
        self._file = open(self._tmp, "wb")
        self._hashing = _HashingFile(self._file)
        # fixed metadata so equal inputs give byte-identical shards (stable checksums)
        self._tar = TarWriter(self._hashing, encoder=False, mtime=0, user="goat", group="goat", mode=0o444)
        self._n_docs = self._n_tokens = self._size = 0

    def _finish(self) -> None:
        self._tar.close()
        self._file.close()
        self._file = None
        commit_file(self._tmp, self.out_dir / self._name)
        self.shards.append(
            {
                "name": self._name,
                "n_docs": self._n_docs,
                "n_tokens": self._n_tokens,
                "bytes": self._hashing.nbytes,
                "sha256": self._hashing.sha.hexdigest(),
            }
        )

    def close(self) -> list[dict]:
        """Finish the current shard; returns the entries of all shards written."""
        if not self._closed:
            if self._file is not None:
                self._finish()
            self._closed = True
        return self.shards

    def abort(self) -> None:
        """Drop the unfinished shard (completed shards stay)."""
        if self._file is not None:
            try:
                self._tar.close()  # marks the tar stream closed so it won't flush into a closed file later
            except Exception:
                pass
            self._file.close()
            self._file = None
            Path(self._tmp).unlink(missing_ok=True)
        self._closed = True


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    """Atomically write `out_dir/manifest.json`; `format` defaults to the current format."""
    manifest = {"format": FORMAT, **manifest}
    if manifest["format"] != FORMAT:
        raise ValueError(f"manifest format must be {FORMAT!r}, got {manifest['format']!r}")
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(dataset_dir: str | os.PathLike) -> dict:
    """Read and sanity-check `dataset_dir/manifest.json`.

    Raises FileNotFoundError when it is missing and ValueError (naming the file) when it is not
    JSON, has another format or lacks required fields.
    """
    path = Path(dataset_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset manifest not found: {path}") from None
    return parse_manifest(data, path)


def parse_manifest(data: bytes | str, path: object) -> dict:
    """Parse and sanity-check manifest JSON; `path` only names the source in errors."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise ValueError(f"dataset manifest {path} is not valid JSON: {exn}") from exn
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"dataset manifest {path} has format {got!r}, expected {FORMAT!r}")
    splits = manifest.get("splits")
    vocab_size = manifest.get("vocab_size")
    if not isinstance(vocab_size, int) or not isinstance(splits, dict):
        raise ValueError(f"dataset manifest {path} lacks an integer 'vocab_size' or a 'splits' object")
    if manifest.get("dtype") != dtype_name(vocab_size):
        got = manifest.get("dtype")
        raise ValueError(f"dataset manifest {path}: dtype {got!r} does not match vocab_size {vocab_size}")
    for split, entries in splits.items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
            raise ValueError(f"dataset manifest {path}: split {split!r} must be a list of shard entries")
    return manifest


def verify_shards(dataset_dir: str | os.PathLike, manifest: dict | None = None) -> None:
    """Check every shard named in the manifest exists with the recorded size and sha256."""
    dataset_dir = Path(dataset_dir)
    manifest = manifest if manifest is not None else read_manifest(dataset_dir)
    for entries in manifest["splits"].values():
        for e in entries:
            path = dataset_dir / e["name"]
            if not path.is_file():
                raise ShardError(f"shard {path} listed in the manifest is missing")
            size = path.stat().st_size
            if size != e["bytes"]:
                raise ShardError(f"shard {path} has {size} bytes, manifest says {e['bytes']}")
            if sha256_file(path) != e["sha256"]:
                raise ShardError(f"shard {path} does not match its sha256 in the manifest")


def decode_ids(sample: dict, shard: str) -> np.ndarray:
    """Token ids of one webdataset sample as a read-only uint16/uint32 array."""
    key = sample.get("__key__")
    fields = [f for f in FIELDS if f in sample]
    if len(fields) != 1:
        found = sorted(k for k in sample if not k.startswith("__"))
        raise ShardError(f"shard {shard}, sample {key!r}: expected one of {sorted(FIELDS)}, found {found}")
    data = sample[fields[0]]
    dtype = FIELDS[fields[0]]
    if len(data) == 0 or len(data) % dtype.itemsize:
        raise ShardError(f"shard {shard}, sample {key!r}: {len(data)} bytes is not a whole number of {dtype}")
    return np.frombuffer(data, dtype=dtype)


def is_url(path: str) -> bool:
    """True for `scheme:...` shard locations (pipe:, http:, s3:, ...) that webdataset's gopen opens."""
    scheme = urlparse(path).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


def open_shard(path: str) -> IO[bytes]:
    """Open a local shard or any URL webdataset's `gopen` accepts; errors name the shard."""
    try:
        return gopen(path, "rb") if is_url(path) else open(path, "rb")
    except Exception as exn:
        raise ShardError(f"cannot open shard {path}: {exn}") from exn


def iter_tar_documents(stream: IO[bytes], shard: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, ids) of every sample of an open tar stream; errors name `shard` and the sample."""
    member = None  # last tar member whose header was read: where an error hits

    def note_member(fname: str) -> bool:
        nonlocal member
        member = fname
        return True

    files = tariterators.tar_file_expander([{"url": shard, "stream": stream}], select_files=note_member)
    samples = iter(tariterators.group_by_keys(files))
    while True:
        try:
            sample = next(samples)
        except StopIteration:
            return
        except Exception as exn:
            key = None if member is None else member.split(".")[0]
            where = "before the first sample" if key is None else f"at or after sample {key!r}"
            detail = exn.args[0] if exn.args else repr(exn)
            raise ShardError(f"corrupt or truncated shard {shard} ({where}): {detail}") from exn
        yield sample["__key__"], decode_ids(sample, shard)


def _iter_shard(path: str) -> Iterator[tuple[str, np.ndarray]]:
    f = open_shard(path)
    try:
        yield from iter_tar_documents(f, path)
    except BaseException:
        try:
            f.close()
        except Exception:
            pass  # the error in hand says more than a pipe's exit status
        raise
    try:
        f.close()
    except Exception as exn:  # a `pipe:` command that failed reports it when closed
        raise ShardError(f"shard {path}: {exn}") from exn


def iter_documents(shard_paths: Iterable[str | os.PathLike]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, token ids) for every document of the shards, in order.

    Reads with webdataset's tar iterators directly (not `wds.WebDataset`, whose default node and
    worker splitters look at RANK/WORLD_SIZE and DataLoader workers): splitting is the caller's job.
    Ids come back as read-only little-endian uint16/uint32 arrays. A truncated or corrupt shard
    raises ShardError naming the shard and the sample.
    """
    if isinstance(shard_paths, (str, os.PathLike)):
        shard_paths = [shard_paths]
    for path in shard_paths:
        yield from _iter_shard(os.fspath(path))


def split_paths(dataset_dir: str | os.PathLike, manifest: dict, split: str) -> list[str]:
    """Absolute shard paths of one split."""
    if split not in manifest["splits"]:
        have = sorted(manifest["splits"])
        raise KeyError(f"split {split!r} not in the manifest of {dataset_dir} (have {have})")
    base = Path(dataset_dir).resolve()
    return [str(base / e["name"]) for e in manifest["splits"][split]]
