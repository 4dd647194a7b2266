"""Writing a safetensors file one tensor at a time, hashing it as it goes.

Why: ``safetensors.torch.save_file`` serialises every tensor into one in-memory buffer first, so a save
needs a second host copy of everything the file holds (and, on a GPU, a host copy of everything before
that). Here the header is computed from shapes and dtypes alone, then each tensor is brought to the host
(``fetch``), written and dropped before the next: a synchronous save holds one tensor on the host, not the
rank's share twice. The sha256 is computed over the bytes as they are written, so publishing a checkpoint
does not read its files back to hash them. Files are read with the ``safetensors`` library, which checks
the header and every offset.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


@dataclass
class Entry:
    """One tensor of the file: its name, dtype and shape, and how to get its (host) value when written."""

    name: str
    dtype: torch.dtype
    shape: Sequence[int]
    fetch: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header(entries: list[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding ``entries`` in order."""
    table: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise TypeError(f"{e.name}: cannot write dtype {e.dtype} (known: {', '.join(map(str, _DTYPES))})")
        table[e.name] = {
            "dtype": _DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def write(path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> dict:
    """Write ``entries`` to ``path`` (fsynced); returns ``{"bytes", "sha256"}`` of what was written.
    An OSError (a full disk) carries ``needed_bytes``, the file's size, for the message (``space``)."""
    head = header(entries, metadata)
    try:
        return _write(path, head, entries)
    except OSError as e:
        e.needed_bytes = len(head) + sum(entry.nbytes for entry in entries)
        raise


def _write(path: Path, head: bytes, entries: list[Entry]) -> dict:
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        f.write(head)
        digest.update(head)
        size += len(head)
        for e in entries:
            value = e.fetch()
            if value.dtype != e.dtype or list(value.shape) != list(e.shape):
                raise ValueError(
                    f"{e.name}: got {value.dtype} {list(value.shape)}, declared {e.dtype} {list(e.shape)}"
                )
            data = memoryview(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
            size += len(data)
            del value, data
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}
