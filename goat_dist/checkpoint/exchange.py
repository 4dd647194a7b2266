"""Reading a checkpoint by file: the way a ZeRO-stage change reads only its share of files.

``Exchange`` is one rank's part (its class docstring says why and how); ``universal.exchange_into`` moves
its requests and data between the replicas with one all-to-all per key.
"""

from __future__ import annotations

import math

import torch

from .errors import CheckpointError
from .index import span
from .slices import UniversalReader, tensor_key

__all__ = ["Exchange"]


class Exchange:
    """One rank's part in a resume that reads the saved files by file and hands each element to the rank
    that holds it: the way a ZeRO-stage change reads only its share of files.

    Why: ZeRO-3 holds 1/R of every parameter on each of R ranks, ZeRO-1/2 a contiguous 1/R of the flat
    optimizer groups (a few whole parameters). Either's share lies in pieces of (nearly) every file the
    other wrote: read directly, a ZeRO-3 rank resuming a ZeRO-1 save opens a file per parameter it finds
    the start of its 1/R in (hundreds at 512 ranks), and a ZeRO-1 rank resuming a ZeRO-3 save every file.
    Instead the R_new replicas of a TP rank read the R_saved files of the same TP rank by file: with
    R_new <= R_saved each reads whole files (replica j: files ``[j * R_saved // R_new, (j + 1) * R_saved
    // R_new)``), else each file is split over its ``R_new / R_saved`` readers as even ranges of its
    elements; an all-to-all then brings each element to its owner. A rank opens
    ``ceil(R_saved / R_new)`` files or one, and reads its share of bytes (every block read is checked
    by the rank that reads it, as in a direct read).

    A file's elements are its pieces for the TP rank in the index's order (parameters, then start): its
    *stream*. Requests and data travel in stream coordinates: ``requests`` says which ranges of which
    file each reader is asked for (and where each lands), ``read`` reads this rank's ranges of one key,
    ``serve`` cuts the answer to every asker, ``place`` copies what arrived into the owned ranges. No
    collective here: ``universal.load`` moves the lists (one process plays every rank in
    ``tests/workers/share_reads.py``)."""

    def __init__(self, reader: UniversalReader, replica: int, replicas: int):
        if not reader.can_exchange():
            raise CheckpointError(f"{reader.where}its files cannot be read by file (no grid of files)")
        self.reader, self.replica, self.replicas = reader, replica, replicas
        self.files = reader.grid[reader.tp_rank]  # saved replica -> index of its file
        self.count = len(self.files)
        self._tables: dict[int, list] = {}
        self._listed: dict[int, dict[str, list[tuple[int, int]]]] | None = None

    # ---- what each saved file holds ---------------------------------------------------------------------
    def table(self, i: int) -> list[tuple[str, int, int, int]]:
        """(parameter, start, numel, offset in the stream) of saved replica ``i``'s file, in stream order
        (kept for the files this rank reads)."""
        found = self._tables.get(i)
        if found is None:
            found = self._tables[i] = list(self._stream(i))
        return found

    def _stream(self, i: int, last: str | None = None):
        """``table(i)``'s rows, up to parameter ``last`` (None: all), without keeping them."""
        reader, offset = self.reader, 0
        for name, rule in reader.meta["pieces"].items():
            n = math.prod(reader.shapes[name])
            if isinstance(rule, dict):
                held = span(rule, n, self.count, i)  # the rule's own reading (index.py)
                spans = [held] if held else []
            else:
                spans = self._listed_pieces().get(self.files[i], {}).get(name, [])
            for start, numel in spans:
                yield name, start, numel, offset
                offset += numel
            if name == last:
                return

    def _listed_pieces(self) -> dict[int, dict[str, list[tuple[int, int]]]]:
        """{file: {parameter: [(start, numel)]}} of this TP rank's listed pieces (ZeRO-1/2's lists)."""
        if self._listed is None:
            self._listed = {}
            for name, rule in self.reader.meta["pieces"].items():
                if isinstance(rule, list):
                    for r, start, numel, f in sorted((int(a), int(b), int(c), int(d)) for a, b, c, d in rule):
                        if r == self.reader.tp_rank and numel > 0:
                            self._listed.setdefault(f, {}).setdefault(name, []).append((start, numel))
        return self._listed

    def _length(self, i: int) -> int:
        table = self.table(i)
        return table[-1][2] + table[-1][3] if table else 0

    # ---- who reads what ---------------------------------------------------------------------------------
    def readers(self, i: int) -> list[tuple[int, int, int]]:
        """(stream start, end, replica) of the readers of saved replica ``i``'s file."""
        if self.replicas <= self.count:
            return [(0, 1 << 62, ((i + 1) * self.replicas - 1) // self.count)]  # the whole file
        first = (i * self.replicas + self.count - 1) // self.count
        last = ((i + 1) * self.replicas + self.count - 1) // self.count
        n, m = self._length(i), last - first
        return [(n * k // m, n * (k + 1) // m, first + k) for k in range(m)]

    def assignment(self, replica: int | None = None) -> list[tuple[int, int, int]]:
        """(saved replica, stream start, end) that ``replica`` (this rank's) reads."""
        j = self.replica if replica is None else replica
        if self.replicas <= self.count:
            lo, hi = j * self.count // self.replicas, (j + 1) * self.count // self.replicas
            return [(i, 0, self._length(i)) for i in range(lo, hi)]
        i = j * self.count // self.replicas
        return [(i, a, z) for a, z, k in self.readers(i) if k == j]

    def requests(self, owned: list[tuple[str, int, int]]):
        """For ``owned`` (parameter, start, numel) ranges: per replica, the (saved replica, stream start,
        end) rows to ask it for, and where each lands: (index into ``owned``, offset in it, numel)."""
        reader = self.reader
        replica_of = {reader.paths[f]: i for i, f in enumerate(self.files) if f is not None}
        order = {name: k for k, name in enumerate(reader.meta["pieces"])}
        needed = {name for name, _, _ in owned}
        last = max(needed, key=order.__getitem__, default=None)
        offsets: dict[int, dict[tuple[str, int], int]] = {}
        asks: list[list] = [[] for _ in range(self.replicas)]
        lands: list[list] = [[] for _ in range(self.replicas)]
        for k, (name, start, numel) in enumerate(owned):
            end = start + numel
            for path, pstart, pnumel in reader._pieces(name, reader.tp_rank, start, end):
                lo, hi = max(start, pstart), min(end, pstart + pnumel)
                if lo >= hi:
                    continue
                i = replica_of[path]
                if i not in offsets:
                    rows = self._tables.get(i) or self._stream(i, last)
                    offsets[i] = {(n, s): o for n, s, _, o in rows if n in needed}
                base = offsets[i][(name, pstart)] - pstart  # stream position of element e: base + e
                for a, z, j in self.readers(i):
                    s_lo, s_hi = max(a, base + lo), min(z, base + hi)
                    if s_lo < s_hi:
                        asks[j].append((i, s_lo, s_hi))
                        lands[j].append((k, s_lo - base - start, s_hi - s_lo))
        return asks, lands

    # ---- reading and routing ----------------------------------------------------------------------------
    def read(self, key: str) -> dict[int, tuple[int, torch.Tensor]]:
        """{saved replica: (stream start, its elements)} of this rank's ranges of ``key``, each piece
        read (and checked) from its file."""
        held = {}
        for i, a, z in self.assignment():
            buf = torch.empty(z - a)
            path = self.reader.paths[self.files[i]]
            for name, _, numel, offset in self.table(i):
                lo, hi = max(a, offset), min(z, offset + numel)
                if lo < hi:
                    data = self.reader._file(path).read(tensor_key(name, key), lo - offset, hi - offset)
                    buf[lo - a : hi - a] = data
                    del data
            held[i] = (a, buf)
        return held

    @staticmethod
    def serve(held: dict[int, tuple[int, torch.Tensor]], asked: list) -> list[torch.Tensor]:
        """Per replica, the elements it asked for (``asked[j]``: rows of saved replica, start, end), in
        the order asked."""
        out = []
        for rows in asked:
            parts = []
            for i, lo, hi in rows:
                base, buf = held[int(i)]
                parts.append(buf[int(lo) - base : int(hi) - base])
            out.append(torch.cat(parts) if parts else torch.empty(0))
        return out

    @staticmethod
    def place(received: list[torch.Tensor], lands: list, dests: list[torch.Tensor]) -> None:
        """Copy what each replica sent (in the order asked) into ``dests`` (one 1-D tensor per owned
        range)."""
        for data, rows in zip(received, lands):
            at = 0
            for k, offset, numel in rows:
                dests[k][offset : offset + numel].copy_(data[at : at + numel])
                at += numel
