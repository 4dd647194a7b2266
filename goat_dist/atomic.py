"""Crash-safe file writes (temp file in the same directory, fsync, os.replace, fsync the directory)
and the file digest that manifests record.

Why: data artifacts (tokenizer, shards, manifest) are read by many ranks, often on shared file
systems; a reader must see either the old complete file or the new complete file, never a torn one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory entry change (rename/create). Best effort where directories can't be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path_for(path: str | os.PathLike) -> Path:
    """A fresh, unused temporary file name next to `path` (same file system, so rename is atomic)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts must be readable by other users of a cache
    return Path(tmp)


def commit_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """fsync `tmp`, atomically rename it onto `path` and fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(Path(path).parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_problem(
    path: str | os.PathLike, size: int, sha256: str | None, checksums: bool = True, name: str | None = None
) -> str | None:
    """What is wrong with ``path`` against its recorded size and sha256, or None when it matches.

    The one check behind every manifest (data shards, checkpoints): callers add which manifest and step.
    ``name`` is how the message names the file (default: its base name)."""
    path = Path(path)
    name = name or path.name
    if not path.is_file():
        return f"{name} is missing"
    actual = path.stat().st_size
    if actual != size:
        return f"{name} has {actual} bytes, expected {size} (truncated?)"
    if checksums and sha256 is not None and sha256_file(path) != sha256:
        return f"{name} does not match its sha256"
    return None
