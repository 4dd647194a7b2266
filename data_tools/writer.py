"""ShardWriter: documents -> size-capped tar shards of the format in `shard_format`.

Why: tar shards stream sequentially from local disks, NFS or object stores and are easy to produce
in parallel (one writer per shard). Beside each shard goes its index (`<shard>.idx.npy`, see
`shard_format`): where each document's token ids start, so a rank reads exactly the windows it trains
on. Each shard is written under a temporary
name and renamed into place only when complete, and is byte-for-byte reproducible (fixed mtime,
owner and mode), so its sha256 in the manifest is stable. Written with the stdlib `tarfile`
(webdataset's TarWriter would import torch); the bytes are the same as webdataset writes.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_tools.digest import HashingFile
from data_tools.shard_format import (
    FIELDS,
    check_key,
    ids_field,
    index_bytes,
    index_name,
    make_index,
    shard_name,
)
from goat_dist.atomic import atomic_write_bytes, commit_file, temp_path_for

_TAR_BLOCK = 512


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
        on_open: Callable[[str], object] | None = None,
    ):
        if shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
        if not prefix or "/" in prefix:
            raise ValueError(f"invalid shard prefix {prefix!r}")
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_bytes = int(shard_size_mb * 1024 * 1024)
        self.vocab_size = vocab_size
        self.field = ids_field(vocab_size)
        self.dtype = FIELDS[self.field]
        # a restarted writer continues the numbering of shards already finished by an earlier run
        self.start_index = start_index
        # told each shard's name before anything of it is written (prepare records it as its own)
        self.on_open = on_open
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

    def write(self, key: str, ids) -> None:
        """Append one document (token ids, EOS included) under `key`."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        check_key(key)
        if key in self._keys:
            raise ValueError(f"duplicate document key {key!r}")
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
        info = tarfile.TarInfo(f"{key}.{self.field}")
        info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "goat", "goat"
        self._tar.addfile(info, io.BytesIO(data))
        self._offsets.append(self._size + _TAR_BLOCK)  # one USTAR header block, then the data
        self._counts.append(arr.size)
        self._keys.add(key)
        self._n_docs += 1
        self._n_tokens += arr.size
        # tar member = header block + data padded to whole blocks
        self._size += _TAR_BLOCK + -(-len(data) // _TAR_BLOCK) * _TAR_BLOCK
        if self._size >= self.max_bytes:
            self._finish()

    def _open(self) -> None:
        self._name = shard_name(self.prefix, self.start_index + len(self.shards))
        if self.on_open is not None:
            self.on_open(self._name)
        self._tmp = temp_path_for(self.out_dir / self._name)
        self._file = open(self._tmp, "wb")
        self._hashing = HashingFile(self._file)
        self._tar = tarfile.open(fileobj=self._hashing, mode="w|", format=tarfile.USTAR_FORMAT)
        self._n_docs = self._n_tokens = self._size = 0
        self._offsets: list[int] = []
        self._counts: list[int] = []

    def _finish(self) -> None:
        self._tar.close()
        self._file.close()
        self._file = None
        commit_file(self._tmp, self.out_dir / self._name)
        index = index_bytes(make_index(self._offsets, self._counts, self._hashing.nbytes))
        atomic_write_bytes(self.out_dir / index_name(self._name), index)
        index_entry = {"name": index_name(self._name), "bytes": len(index)}
        index_entry["sha256"] = hashlib.sha256(index).hexdigest()
        self.shards.append(
            {
                "name": self._name,
                "n_docs": self._n_docs,
                "n_tokens": self._n_tokens,
                "bytes": self._hashing.nbytes,
                "sha256": self._hashing.sha256,
                "index": {
                    "name": index_name(self._name),
                    "bytes": len(index),
                    "sha256": hashlib.sha256(index).hexdigest(),
                },
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
