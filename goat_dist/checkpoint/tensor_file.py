"""Writing a safetensors file one tensor at a time, hashing it as it goes; reading ranges of one back.

Why: ``safetensors.torch.save_file`` serialises every tensor into one in-memory buffer first, so a save
needs a second host copy of everything the file holds (and, on a GPU, a host copy of everything before
that). Here the header is computed from shapes and dtypes alone, then each tensor is brought to the host
(``fetch``), written and dropped before the next: a synchronous save holds one tensor on the host, not the
rank's share twice. The sha256 is computed over the bytes as they are written, so publishing a checkpoint
does not read its files back to hash them.

Checksums (``write(..., checksums=True)``, the universal state's files): every tensor is cut into at most
``BLOCKS_MAX`` blocks of at least ``BLOCK_MIN`` elements and each block's CRC-32 is stored in the file, as
its last tensor (``__crc32__``). A reader that needs a part of a file (another layout's range of it) reads
the blocks around that part and checks them, without reading the rest of the file: the whole-file sha256
of the manifest could only be checked by reading all of it.

Aligned blocks (``Entry.block``): a tensor that another layout reads as column ranges of its rows (a
row-parallel weight's piece, read at a larger TP: ``slices.py``) is cut instead into blocks of ``block``
elements aligned to the rows it was cut from: block boundaries fall where ``phase + i`` is a multiple of
``block`` (``phase``: where the piece starts in its rows, modulo ``block``). With ``block`` a fraction of
the row, each column range such a reader takes is whole blocks, read and checked exactly. Such a file
lists its aligned tensors in its metadata (``crc32_aligned``: [k, block, phase], k the tensor's place in
the data, first = 0) instead of the plain rule (``crc32_blocks``):
a reader of an earlier release finds no rule it knows, takes the file for one without checksums and checks
it whole against the manifest's sha256. CRC-32 finds the damage storage does (torn or
truncated writes, flipped bits) as a hash would; it is not a defence against someone rewriting the file
(neither is the sha256: the manifest is not signed).

``TensorFile`` reads a safetensors file with ``pread``: opened once for any number of ranges, nothing is
memory-mapped (the pages a mapped read touches stay in the process's RSS while the file is open), and each
range costs its bytes (plus, with checksums, the blocks around it). Its header is checked as the
``safetensors`` library checks one (known dtypes, offsets inside the file and matching the shapes); every
problem is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.uint8: "U8",
}
_READ_DTYPES = {
    **{v: k for k, v in _DTYPES.items()},
    "F64": torch.float64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "BOOL": torch.bool,
}
CHECKSUMS = "__crc32__"  # the name of the checksum tensor
BLOCK_MIN = 256  # elements: a block is at least this long ...
BLOCKS_MAX = 64  # ... and a tensor has at most this many (a partial read overreads < 2 / 64 of a tensor)
_RULE_KEY = "crc32_blocks"  # metadata: "BLOCK_MIN:BLOCKS_MAX" as written
_ALIGNED_KEY = "crc32_aligned"  # metadata, instead: {"rule": ..., "tensors": [[k, block, phase]]}
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass
class Entry:
    """One tensor of the file: its name, dtype and shape, and how to get its (host) value when written."""

    name: str
    dtype: torch.dtype
    shape: Sequence[int]
    fetch: Callable[[], torch.Tensor]
    block: int = 0  # elements per checksum block, aligned (module docstring); 0: the plain rule
    phase: int = 0  # with ``block``: block boundaries where ``phase + i`` is a multiple of ``block``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Checksums(Entry):
    """The last tensor of a checksummed file: the CRC-32 of every block of the tensors before it."""

    block_min: int = BLOCK_MIN
    blocks_max: int = BLOCKS_MAX
    sums: list = field(default_factory=list)


def block_size(numel: int, block_min: int = BLOCK_MIN, blocks_max: int = BLOCKS_MAX) -> int:
    """Elements per checksum block of a tensor of ``numel`` elements."""
    return max(block_min, -(-numel // blocks_max))


def _blocks(numel: int, block: int, phase: int = 0) -> int:
    """How many checksum blocks a tensor of ``numel`` elements has (blocks of ``block``, ``phase``)."""
    return (numel - 1 + phase) // block + 1 if numel else 0


def _geometry(e: Entry) -> tuple[int, int]:
    """(block, phase) of entry ``e``'s checksum blocks."""
    if e.block:
        if not 0 <= e.phase < e.block:
            raise ValueError(f"{e.name}: checksum phase {e.phase} outside [0, {e.block})")
        return e.block, e.phase
    return block_size(math.prod(e.shape)), 0


def block_span(numel: int, block: int, phase: int, lo: int, hi: int) -> tuple[int, int, int]:
    """(first block, its first element, the element after the last block) of the blocks around the
    elements ``[lo, hi)`` (``hi > lo``) of a tensor of ``numel`` elements."""
    first, last = (lo + phase) // block, (hi - 1 + phase) // block
    return first, max(0, first * block - phase), min(numel, (last + 1) * block - phase)


def with_checksums(entries: list[Entry], metadata: dict[str, str] | None) -> tuple[list[Entry], dict]:
    """``entries`` plus the checksum tensor, and ``metadata`` plus the block rule a reader needs."""
    count = sum(_blocks(math.prod(e.shape), *_geometry(e)) for e in entries)
    table = Checksums(CHECKSUMS, torch.uint8, [count, 4], fetch=lambda: torch.empty(0))
    rule = f"{BLOCK_MIN}:{BLOCKS_MAX}"
    aligned = [[k, e.block, e.phase] for k, e in enumerate(entries) if e.block]
    if aligned:
        text = json.dumps({"rule": rule, "tensors": aligned}, separators=(",", ":"))
        return [*entries, table], {**(metadata or {}), _ALIGNED_KEY: text}
    return [*entries, table], {**(metadata or {}), _RULE_KEY: rule}


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


def write(
    path: Path, entries: list[Entry], metadata: dict[str, str] | None = None, checksums: bool = False
) -> dict:
    """Write ``entries`` to ``path`` (fsynced); returns ``{"bytes", "sha256", "header_sha256"}`` of what
    was written. ``checksums``: with the block CRC-32s (module docstring). An OSError (a full disk)
    carries ``needed_bytes``, the file's size, for the message (``space``)."""
    if checksums:
        entries, metadata = with_checksums(entries, metadata)
    head = header(entries, metadata)
    try:
        written = _write(path, head, entries)
    except OSError as e:
        e.needed_bytes = len(head) + sum(entry.nbytes for entry in entries)
        raise
    return {**written, "header_sha256": hashlib.sha256(head).hexdigest()}


def _write(path: Path, head: bytes, entries: list[Entry]) -> dict:
    digest = hashlib.sha256()
    size = 0
    table = next((e for e in entries if isinstance(e, Checksums)), None)
    with open(path, "wb") as f:
        f.write(head)
        digest.update(head)
        size += len(head)
        for e in entries:
            if e is table:
                data = np.asarray(table.sums, dtype="<u4").view(np.uint8)
                f.write(data)
                digest.update(data)
                size += data.nbytes
                continue
            value = e.fetch()
            if value.dtype != e.dtype or list(value.shape) != list(e.shape):
                raise ValueError(
                    f"{e.name}: got {value.dtype} {list(value.shape)}, declared {e.dtype} {list(e.shape)}"
                )
            data = memoryview(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
            size += len(data)
            if table is not None:
                block, phase = _geometry(e)
                step, first = block * value.element_size(), (block - phase) * value.element_size()
                cuts = [0, *range(first, len(data), step), len(data)]
                table.sums.extend(zlib.crc32(data[a:z]) for a, z in zip(cuts, cuts[1:]) if z > a)
            del value, data
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


# ---- reading ---------------------------------------------------------------------------------------------
_CODES = tuple(_READ_DTYPES.values())


class TensorFile:
    """One safetensors file, opened once for ranged reads (module docstring). ``label`` names it in errors,
    after ``where`` (the checkpoint and step); ``expect``: the manifest's record of it (``bytes``;
    ``header_sha256`` for a checksummed file; a file without checksums is checked against ``sha256`` whole,
    once, when opened: a file of an earlier release).

    Its table of tensors is kept in arrays (~70 bytes a tensor, names shared between files): an export of a
    512-rank checkpoint holds 512 files open, each with a few thousand tensors."""

    def __init__(
        self, path: Path | str, label: str | None = None, where: str = "", expect: dict | None = None
    ):
        self.path = Path(path)
        self.label = label or self.path.name
        self.where = where
        self.fd = None
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self.error("is missing") from None
        except OSError as e:
            raise self.error(f"cannot be opened: {e.strerror or e}") from None
        try:
            self._parse(expect or {})
            if expect and self.checksums is None and expect.get("sha256"):
                self._check_whole(expect["sha256"])
        except BaseException:
            self.close()
            raise

    def error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.where}{self.label} {what}")

    def close(self, _close=os.close) -> None:
        if self.fd is not None:
            _close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            self.close()

    # ---- header ---------------------------------------------------------------------------------------
    def _parse(self, expect: dict) -> None:
        self.size = os.fstat(self.fd).st_size
        if "bytes" in expect and self.size != int(expect["bytes"]):
            raise self.error(f"has {self.size} bytes, expected {expect['bytes']} (truncated?)")
        if self.size < 8:
            raise self.error(f"is not a safetensors file: {self.size} bytes (truncated?)")
        (length,) = struct.unpack("<Q", self._pread(0, 8))
        if length > _MAX_HEADER or 8 + length > self.size:
            raise self.error(
                f"is not a safetensors file: a header of {length} bytes in {self.size} (truncated?)"
            )
        raw = self._pread(8, length)
        written = expect.get("header_sha256")
        if written and hashlib.sha256(struct.pack("<Q", length) + raw).hexdigest() != written:
            raise self.error("does not match its sha256 (its header differs from what was written)")
        try:
            table = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(f"has a corrupt header (not JSON: {e})") from None
        if not isinstance(table, dict):
            raise self.error("has a corrupt header (not a JSON object)")
        self.metadata = table.pop("__metadata__", None) or {}
        data_start, data_bytes = 8 + length, self.size - 8 - length
        self._slot: dict[str, int] = {}
        self._begin, self._numel, self._first = array("q"), array("q"), array("q")
        self._block, self._phase = array("q"), array("q")  # each tensor's checksum blocks
        self._dtype = bytearray()
        self._shapes: dict[str, tuple[int, ...]] = {}  # of the tensors that are not 1-D
        spans = []
        for name, info in table.items():
            try:
                code = _CODES.index(_READ_DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                lo, hi = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self.error(f"has a corrupt header (tensor {name!r}: {info!r})") from None
            numel = math.prod(shape)
            if min(shape, default=0) < 0 or hi - lo != numel * _CODES[code].itemsize or lo < 0:
                raise self.error(
                    f"has a corrupt header (tensor {name!r}: shape {list(shape)}, bytes {lo}-{hi})"
                )
            if hi > data_bytes:
                raise self.error(f"is shorter than its header says ({self.size} bytes; truncated?)")
            name = sys.intern(name)  # the same names in every file of a checkpoint: one string each
            self._slot[name] = len(self._begin)
            self._begin.append(data_start + lo)
            self._numel.append(numel)
            self._first.append(0)
            self._block.append(0)
            self._phase.append(0)
            self._dtype.append(code)
            if len(shape) != 1:
                self._shapes[name] = shape
            spans.append((lo, hi))
        end = 0
        for lo, hi in sorted(spans):
            if lo != end:
                break
            end = hi
        if end != data_bytes:
            raise self.error("has a corrupt header (its tensors do not cover its data exactly; truncated?)")
        self.checksums = self._checksum_rule()

    def _checksum_rule(self) -> tuple[int, int] | None:
        rule, aligned = self.metadata.get(_RULE_KEY), {}
        if CHECKSUMS not in self._slot or (rule is None and _ALIGNED_KEY not in self.metadata):
            return None
        try:
            if rule is None:
                layout = json.loads(self.metadata[_ALIGNED_KEY])
                rule = layout["rule"]
                aligned = {int(k): (int(b), int(p)) for k, b, p in layout["tensors"]}
            block_min, blocks_max = (int(x) for x in rule.split(":"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise self.error(f"has a corrupt header (checksum rule {rule!r})") from None
        table = self._slot[CHECKSUMS]
        first = 0
        for k, i in enumerate(sorted(range(len(self._begin)), key=self._begin.__getitem__)):
            if i != table:
                block, phase = aligned.get(k, (block_size(self._numel[i], block_min, blocks_max), 0))
                if not 0 <= phase < block:
                    raise self.error(f"has a corrupt header (checksum blocks of tensor {k})")
                self._first[i], self._block[i], self._phase[i] = first, block, phase
                first += _blocks(self._numel[i], block, phase)
        if self._shapes.get(CHECKSUMS) != (first, 4):
            raise self.error(f"has a corrupt header (checksum table {self.shape(CHECKSUMS)}, {first} blocks)")
        return block_min, blocks_max

    def _check_whole(self, sha256: str) -> None:
        digest, offset, buf = hashlib.sha256(), 0, torch.empty(4 << 20, dtype=torch.uint8)
        while offset < self.size:
            n = min(buf.numel(), self.size - offset)
            self._pread(offset, n, into=buf[:n])
            digest.update(memoryview(buf.numpy())[:n])
            offset += n
        if digest.hexdigest() != sha256:
            raise self.error("does not match its sha256")

    # ---- the tensors ----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._slot)

    def __contains__(self, name: str) -> bool:
        return name in self._slot

    def _index(self, name: str) -> int:
        try:
            return self._slot[name]
        except KeyError:
            raise self.error(f"has no tensor {name!r}") from None

    def shape(self, name: str) -> list[int]:
        i = self._index(name)
        return list(self._shapes.get(name, (self._numel[i],)))

    def numel(self, name: str) -> int:
        return self._numel[self._index(name)]

    # ---- data -----------------------------------------------------------------------------------------
    def _pread(self, offset: int, nbytes: int, into: torch.Tensor | None = None):
        """``nbytes`` at ``offset``, read into the uint8 tensor ``into`` (or returned as bytes)."""
        out = torch.empty(nbytes, dtype=torch.uint8) if into is None else into
        view, done = memoryview(out.numpy()), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise self.error(f"ends before byte {offset + nbytes} (truncated?)")
            done += got
        return out if into is not None else bytes(view)

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name``, flattened (its own dtype); with checksums, the blocks
        around them are read and checked."""
        i = self._index(name)
        numel, dtype = self._numel[i], _CODES[self._dtype[i]]
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise self.error(f"has no elements [{lo}, {hi}) of {name!r} (it has {numel})")
        size = dtype.itemsize
        a, z, first = lo, hi, -1
        if self.checksums is not None and hi > lo:
            first, a, z = block_span(numel, self._block[i], self._phase[i], lo, hi)
        buf = torch.empty((z - a) * size, dtype=torch.uint8)
        if z > a:
            self._pread(self._begin[i] + a * size, (z - a) * size, into=buf)
        if first >= 0:
            self._check_blocks(name, i, first, a, buf, size)
        return buf.view(dtype)[lo - a : hi - a]

    def _check_blocks(self, name: str, i: int, first: int, a: int, buf: torch.Tensor, size: int) -> None:
        """``buf`` (tensor ``i``'s elements from ``a``, the start of its block ``first``, to the end of a
        block) against the stored CRC-32s."""
        block, phase = self._block[i], self._phase[i]
        z = a + buf.numel() // size
        cuts = [a, *range((first + 1) * block - phase, z, block), z]
        table = self._begin[self._slot[CHECKSUMS]]
        raw = self._pread(table + 4 * (self._first[i] + first), 4 * (len(cuts) - 1))
        expected = np.frombuffer(raw, dtype="<u4")
        data = memoryview(buf.numpy())
        for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            if zlib.crc32(data[(lo - a) * size : (hi - a) * size]) != int(expected[k]):
                raise self.error(
                    f"does not match its checksums: block {first + k} of {name!r} (elements from {lo}) is "
                    "corrupt"
                )

    def read_whole(self, name: str) -> torch.Tensor:
        """Tensor ``name`` with its shape."""
        return self.read(name).reshape(self.shape(name))
