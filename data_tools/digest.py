"""sha256 and size of the bytes streaming through a file object, written or read.

Why: the writer records each shard's digest while writing it and `inspect` checks it while
decoding it, so neither reads a shard twice. Whole files on disk are hashed by
`goat_dist.atomic.sha256_file` (and checked by `goat_dist.atomic.file_problem`).
"""

from __future__ import annotations

import hashlib
from typing import IO


class HashingFile:
    """Wraps a binary file; `sha256`/`nbytes` cover everything written to or read from it."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self._sha = hashlib.sha256()
        self.nbytes = 0

    def _seen(self, data) -> None:
        self._sha.update(data)
        self.nbytes += len(data)

    def write(self, data) -> int:
        self.f.write(data)
        self._seen(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self._seen(data)
        return data

    def flush(self) -> None:
        self.f.flush()

    def read_rest(self, chunk: int = 1 << 20) -> None:
        """Read (and hash) what the reader left, e.g. the tar end-of-archive padding."""
        while self.read(chunk):
            pass

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()
