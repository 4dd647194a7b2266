"""Reading only the part of a universal checkpoint that one rank owns, and checking what is read.

Why: a universal resume used to build the whole TP-merged fp32 model and both Adam moments on every rank
(~12 bytes per parameter per rank) and then keep its slice. Here a rank asks for a flat range of its
*local* tensor (its TP slice, in the new layout) and gets exactly that from the files of the saved layout.

Which files: ``universal/index.json`` says, per parameter, how the saved ranks split its TP-local tensor
into pieces: a rule for ZeRO-3 and the replicated layouts (``even``: replica i holds elements
``[i * P, (i + 1) * P)``; ``share``: ``[n * i // R, n * (i + 1) // R)``; ``flat`` for ZeRO-1/2, whose
pieces follow the optimizer's flat groups: a run of consecutive replicas, ``index.flat_spans``), a list only
where no rule fits, and ``grid[t][i]`` names the file of TP rank t's replica i (format 3: the rule
``tp_inner``, rank ``i * tp + t``, and file names ``file_name(rank)``). So a rank finds its pieces without
reading every rank's: the index is O(parameters) (format 2, listing files, grid and ZeRO-1/2's pieces:
O(parameters + ranks)), where the full list of ``meta.json`` (written by earlier releases, no
longer) is O(parameters x ranks): 213k pieces, 4.4 MB, ~100 MB parsed, at 30B on 512 ranks under ZeRO-3.

How ranges map: on the TP size that saved it, a local flat range is the same flat range of the saved
local tensor, read piece by piece with no padding; on the layout that saved it, that is exactly the rank's
own file. Across TP sizes (megatron's ``partition_dim`` d and ``partition_stride`` s): along d the full
tensor is s blocks; block b is the concatenation over TP ranks of each rank's b-th chunk. A rank's local
tensor along d is, for every block, its own chunk. So a local index along d names (block, offset in
block), the offset names the saved rank and its local index. A flat range of the local tensor is read as
(at most) a partial first row, whole rows and a partial last row, and each of those rectangles as exactly
its part of every saved rank: along dim 0, rows of the saved tensors; along dim 1 (the row-parallel
weights), the same rows' column ranges, one read per row, whose checksum blocks the writer aligned to
those columns (``universal.checksum_blocks``), so a TP increase reads its share and no whole rows.

A ZeRO-stage change reads by file instead (``exchange.Exchange``): a ZeRO-3 rank's share lies in pieces of
nearly every file a ZeRO-1/2 world wrote and the other way round, so each rank reads the files of its
place in the saved world and an all-to-all brings every element to its owner.

Checks: every file is opened once (``tensor_file.TensorFile``, kept for all its ranges until ``close``),
its size and header against the manifest, and each range against the block checksums stored in the file;
a file of an earlier release (no checksums) is hashed whole against the manifest when first opened. Files
this rank does not read are neither opened nor stat'ed. Format 1 (``universal/tp<R>.safetensors``, one
file per TP rank with whole TP-local tensors) and format 2 without an index (``meta.json`` only) are read
the same way, through their ``meta.json``, as one piece per tensor or from the full list.
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import resource
from collections.abc import Sequence
from pathlib import Path

import torch

from .digests import read_checked
from .errors import CheckpointError
from .index import INDEX, file_name, flat_spans
from .tensor_file import CHECKSUMS, TensorFile

META = "meta.json"


class _RankFiles(Sequence):
    """``universal/file_name(r)`` for every rank r of a ``world``: the index's file list as a rule."""

    def __init__(self, world: int):
        self.world = world

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, rank: int) -> str:  # type: ignore[override]  # ints only: never sliced
        if not 0 <= rank < self.world:
            raise IndexError(rank)
        return f"universal/{file_name(rank)}"


class _TpInner(Sequence):
    """Row ``t`` of the index's grid as a rule: saved replica i's file is rank ``i * tp + t``'s."""

    def __init__(self, t: int, tp: int, replicas: int):
        self.t, self.tp, self.replicas = t, tp, replicas

    def __len__(self) -> int:
        return self.replicas

    def __getitem__(self, i: int) -> int:  # type: ignore[override]  # ints only: never sliced
        if not 0 <= i < self.replicas:
            raise IndexError(i)
        return i * self.tp + self.t


def tensor_key(name: str, key: str) -> str:
    """The safetensors key of a parameter's value ("") or of one of its Adam moments."""
    return f"{name}::{key}" if key else name


class UniversalReader:
    """The universal state of one checkpoint, as seen by TP rank ``tp_rank`` of a TP=``tp`` layout.

    ``manifest`` (the checkpoint's, as read by the caller): the size, header and content of every file
    read are checked against it; without one (tools and tests on a bare ``universal/`` directory) only the
    files' own checksums are checked. The pieces are found through ``index.json``, or through
    ``meta.json`` in a checkpoint of an earlier release that has no index (the manifest says which; without
    one, the files present do). Close it (or use it as a context manager) to release its open files."""

    def __init__(self, step_dir: Path, tp: int, tp_rank: int, manifest: dict | None = None):
        self.step_dir = Path(step_dir)
        self.manifest = manifest
        step = f" (step {manifest.get('step')})" if manifest else ""
        self.where = f"checkpoint {self.step_dir}{step}: "
        self.tp, self.tp_rank = tp, tp_rank
        self._files: dict[str, TensorFile] = {}
        self._lists: dict[str, list] = {}
        if manifest is not None:
            indexed = f"universal/{INDEX}" in manifest["files"]
        else:
            indexed = (self.step_dir / "universal" / INDEX).is_file()
        self.index_name = f"universal/{INDEX if indexed else META}"
        raw = read_checked(self.step_dir, self.index_name, manifest)
        try:
            self.meta = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{self.where}{self.index_name} is not valid JSON: {e}") from None
        self.format = int(self.meta.get("format", 1))
        self.saved_tp = int(self.meta["tp"])
        self.paths: Sequence[str]
        if self.format == 1:
            self.paths = [f"universal/tp{r:02d}.safetensors" for r in range(self.saved_tp)]
            own = self._file(self.paths[min(tp_rank, self.saved_tp - 1)])
            self.shapes = {k: own.shape(k) for k in own.names() if k != CHECKSUMS}
        elif self.format in (2, 3):
            listed = self.meta.get("files")
            self.paths = (
                [f"universal/{name}" for name in listed]
                if listed is not None
                else _RankFiles(int(self.meta["world"]))
            )
            self.shapes = {name: list(m["shape"]) for name, m in self.meta["params"].items()}
            grid = self.meta.get("grid")
            if isinstance(grid, dict):  # format 3's rule (index.py)
                replicas = int(self.meta["replicas"])
                grid = [_TpInner(t, self.saved_tp, replicas) for t in range(self.saved_tp)]
            self.grid = grid
        else:
            raise CheckpointError(
                f"{self.step_dir}: {self.index_name} is format {self.format}; this goat-dist reads "
                "formats 1 to 3 (a newer goat-dist wrote it: upgrade to resume from it)"
            )

    # ---- files ----------------------------------------------------------------------------------------
    def _file(self, name: str) -> TensorFile:
        """The open file ``name`` (relative to the step directory), checked when first opened."""
        f = self._files.get(name)
        if f is None:
            expect = None
            if self.manifest is not None:
                expect = self.manifest["files"].get(name)
                if expect is None:
                    raise CheckpointError(f"{self.where}{name} is not in its manifest")
            _room_for(len(self._files) + 1)
            f = self._files[name] = TensorFile(self.step_dir / name, name, self.where, expect)
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def with_layout(self, tp: int, tp_rank: int) -> UniversalReader:
        """The same checkpoint (and open files) seen by TP rank ``tp_rank`` of TP=``tp``."""
        other = copy.copy(self)
        other.tp, other.tp_rank = tp, tp_rank
        return other

    def can_exchange(self) -> bool:
        """Whether this checkpoint can be read by file on this TP size (``Exchange``): the index's grid of
        files, and the TP size that saved it."""
        return self.format >= 2 and self.grid is not None and self.saved_tp == self.tp

    def files_for(self, owned) -> int:
        """How many files a direct read of ``owned`` ((parameter, start, numel) ranges) opens (none is)."""
        paths: set[str] = set()
        for name, start, numel in owned:
            same = self._same_rank(name)
            if same is None or numel <= 0:  # a TP change: found as read (not counted)
                continue
            paths.update(path for path, _, _ in self._pieces(name, same, start, start + numel))
        return len(paths)

    # ---- pieces ---------------------------------------------------------------------------------------
    def _pieces(self, name: str, rank: int, lo: int, hi: int):
        """(file, start, numel) of the pieces of saved TP rank ``rank``'s flat local tensor that overlap
        ``[lo, hi)``, in order."""
        if self.format == 1:
            yield self.paths[rank], 0, math.prod(self.shapes[tensor_key(name, "")])
            return
        rule = self.meta["pieces"].get(name)
        n = math.prod(self.shapes[name])
        if isinstance(rule, dict) and self.grid is not None:
            files = self.grid[rank]
            count = len(files)
            if "even" in rule:
                size = int(rule["even"])
                first, last = lo // size, min(count, -(-hi // size))
                bounds = [(i, i * size, min(n, (i + 1) * size)) for i in range(first, last)]
            elif "flat" in rule:
                i0, head, part = (int(v) for v in rule["flat"])
                first = i0 if lo < head else i0 + 1 + (lo - head) // part
                last = i0 + 1 if hi <= head else i0 + 2 + (hi - 1 - head) // part
                spans = flat_spans(rule["flat"], n, first, min(last, count))
                bounds = [(i, a, a + k) for i, (a, k) in spans.items()]
            else:
                first = max(0, lo * count // n - 1) if n else 0
                bounds = []
                for i in range(first, count):
                    a, z = n * i // count, n * (i + 1) // count
                    if a >= hi:
                        break
                    if z > lo:
                        bounds.append((i, a, z))
            for i, a, z in bounds:
                if z > a and files[i] is not None:
                    yield self.paths[files[i]], a, z - a
            return
        pieces = self._lists.get(name)
        if pieces is None:
            listed = rule if isinstance(rule, list) else []
            pieces = self._lists[name] = sorted((int(r), int(s), int(c), int(f)) for r, s, c, f in listed)
        j = max(0, bisect.bisect_right(pieces, (rank, lo, math.inf, math.inf)) - 1)
        for r, start, numel, f in pieces[j:]:
            if r > rank or start >= hi:
                break
            if r == rank and start + numel > lo and numel > 0:
                yield self.paths[f], start, numel

    def _saved_flat(self, rank: int, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of saved TP rank ``rank``'s flattened local tensor, from the pieces that
        hold them, each read (and checked) from its file."""
        out, cursor, gap_end = None, lo, hi
        k = tensor_key(name, key)
        for path, start, numel in self._pieces(name, rank, lo, hi):
            if start + numel <= cursor:
                continue
            if start > cursor:
                gap_end = start
                break
            end = min(hi, start + numel)
            data = self._file(path).read(k, cursor - start, end - start)
            if end - cursor == hi - lo:
                return data
            if out is None:
                out = torch.empty(hi - lo, dtype=data.dtype)
            out[cursor - lo : end - lo] = data
            del data
            cursor = end
            if cursor >= hi:
                break
        if cursor < hi:
            raise CheckpointError(
                f"{self.step_dir}: universal state lacks elements [{cursor}, {gap_end}) of {k} on saved TP "
                f"rank {rank} ({self.index_name} lists no piece holding them)"
            )
        return out if out is not None else torch.empty(0)

    def _block(self, rank: int, name: str, key: str, index) -> torch.Tensor:
        """``saved local tensor of TP rank rank``[index]; ``index`` is ``...`` (a 0-d tensor) or a tuple whose
        first entry is a row slice (the rest slices the other dims)."""
        shape = self.saved_shape(name, key)
        if not shape:
            return self._saved_flat(rank, name, key, 0, 1).reshape(())
        rows = index[0]
        row = math.prod(shape[1:])
        r0, r1 = rows.start or 0, shape[0] if rows.stop is None else min(rows.stop, shape[0])
        block = self._saved_flat(rank, name, key, r0 * row, r1 * row).reshape(r1 - r0, *shape[1:])
        return block[(slice(None), *index[1:])] if len(index) > 1 else block

    def saved_local(self, rank: int, name: str, key: str = "") -> torch.Tensor:
        """Saved TP rank ``rank``'s whole local tensor (one-process tools and tests)."""
        shape = self.saved_shape(name, key)
        return self._saved_flat(rank, name, key, 0, math.prod(shape)).reshape(shape)

    # ---- shapes ---------------------------------------------------------------------------------------
    def split_of(self, name: str) -> dict:
        try:
            return self.meta["params"][name]
        except KeyError:
            raise CheckpointError(f"{self.step_dir}: universal state has no parameter {name}") from None

    def _is_split(self, name: str) -> bool:
        return bool(self.split_of(name)["tp_split"]) and not (self.saved_tp == 1 and self.tp == 1)

    def _same_rank(self, name: str) -> int | None:
        """The saved TP rank whose local tensor is this rank's, element for element (None: a TP change of
        a split parameter, whose local tensor is cut from several)."""
        if not self._is_split(name):
            return self.tp_rank if self.saved_tp == self.tp else 0
        return self.tp_rank if self.saved_tp == self.tp else None

    def saved_shape(self, name: str, key: str = "") -> list[int]:
        return list(self.shapes[tensor_key(name, key) if self.format == 1 else name])

    def local_shape(self, name: str) -> list[int]:
        shape = self.saved_shape(name)
        if self._is_split(name):
            d = self.split_of(name)["dim"]
            full = shape[d] * self.saved_tp
            stride = self.split_of(name)["stride"]
            if full % (stride * self.tp) or full % (stride * self.saved_tp):
                raise CheckpointError(
                    f"{self.step_dir}: parameter {name} (size {full} along dim {d}, stride {stride}) "
                    f"cannot be split over TP={self.tp}"
                )
            shape[d] = full // self.tp
        return shape

    # ---- reading --------------------------------------------------------------------------------------
    def _runs(self, name: str, length: int) -> list[tuple[int, int, int]]:
        """(saved TP rank, start, end) along the split dim, in the order they make up the local tensor."""
        m = self.split_of(name)
        stride = m["stride"]
        new_chunk = length // stride
        old_chunk = new_chunk * self.tp // self.saved_tp
        runs = []
        for block in range(stride):
            lo, hi = self.tp_rank * new_chunk, (self.tp_rank + 1) * new_chunk
            while lo < hi:
                rank = lo // old_chunk
                end = min(hi, (rank + 1) * old_chunk)
                start_old = block * old_chunk + lo - rank * old_chunk
                runs.append((rank, start_old, start_old + end - lo))
                lo = end
        return runs

    def _saved_rect(self, rank: int, name: str, key: str, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows ``[r0, r1)``, columns ``[c0, c1)`` of saved TP rank ``rank``'s local tensor seen as
        ``[rows, row]`` (``row``: the product of its other dims): whole rows as one range, else one range
        per row (strided reads; the checksum blocks of row-parallel tensors are aligned to those
        columns: ``universal.checksum_blocks``)."""
        shape = self.saved_shape(name, key)
        row = math.prod(shape[1:])
        if c0 == 0 and c1 == row:
            return self._saved_flat(rank, name, key, r0 * row, r1 * row).reshape(r1 - r0, row)
        out = None
        for r in range(r0, r1):
            part = self._saved_flat(rank, name, key, r * row + c0, r * row + c1)
            if out is None:
                out = torch.empty(r1 - r0, c1 - c0, dtype=part.dtype)
            out[r - r0] = part
            del part
        return out if out is not None else torch.empty(0, c1 - c0)

    def _region(self, name: str, key: str, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows ``[r0, r1)``, columns ``[c0, c1)`` of this rank's local tensor seen as ``[rows, row]``, on
        a TP change of a split parameter: each saved rank's part of exactly that rectangle is read (a split
        along dim 1 makes the saved ranks' parts column ranges of the same rows) and copied into place."""
        d = self.split_of(name)["dim"]
        shape = self.local_shape(name)
        inner = math.prod(shape[d + 1 :])  # elements per index along the split dim, inside a row
        if d > 1:  # not a megatron layout: whole saved rows, cut here
            return self._region_by_rows(name, key, r0, r1, c0, c1)
        out = None
        cursor = 0
        for rank, a, z in self._runs(name, shape[d]):
            run_lo, run_hi = cursor, cursor + z - a  # where this run sits in the local tensor along d
            cursor = run_hi
            if d == 0:  # rows of the saved rank, the same columns
                lo, hi = max(r0, run_lo), min(r1, run_hi)
                if lo >= hi:
                    continue
                block = self._saved_rect(rank, name, key, a + lo - run_lo, a + hi - run_lo, c0, c1)
                target = (slice(lo - r0, hi - r0), slice(None))
            else:  # columns of the saved rank (of every row)
                lo, hi = max(c0, run_lo * inner), min(c1, run_hi * inner)
                if lo >= hi:
                    continue
                shift = a * inner - run_lo * inner
                block = self._saved_rect(rank, name, key, r0, r1, lo + shift, hi + shift)
                target = (slice(None), slice(lo - c0, hi - c0))
            if out is None:
                out = torch.empty(r1 - r0, c1 - c0, dtype=block.dtype)
            out[target] = block
            del block
        return out if out is not None else torch.empty(r1 - r0, c1 - c0)

    def _region_by_rows(self, name: str, key: str, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """``_region`` for a split along a dim past 1: whole rows of each saved rank, cut here."""
        d = self.split_of(name)["dim"]
        shape = self.local_shape(name)
        shape[0] = r1 - r0
        out, cursor = None, 0
        for rank, a, z in self._runs(name, self.local_shape(name)[d]):
            run_lo, run_hi = cursor, cursor + z - a
            cursor = run_hi
            index = [slice(None)] * (d + 1)
            index[0], index[d] = slice(r0, r1), slice(a, z)
            block = self._block(rank, name, key, tuple(index))
            if out is None:
                out = torch.empty(shape, dtype=block.dtype)
            out.narrow(d, run_lo, run_hi - run_lo).copy_(block)
            del block
        if out is None:
            out = torch.empty(shape)
        return out.reshape(r1 - r0, -1)[:, c0:c1]

    def read_rows(self, name: str, key: str, row0: int, row1: int) -> torch.Tensor:
        """Rows ``[row0, row1)`` (dim 0) of this rank's local tensor; a 0-d tensor whole. Across TP sizes
        each saved rank's part is read as exactly its rows or columns and copied into place (``_region``)."""
        if len(self.saved_shape(name)) == 0:
            return self._block(0, name, key, ...)
        same = self._same_rank(name)
        if same is not None:
            return self._block(same, name, key, (slice(row0, row1),))
        shape = self.local_shape(name)
        row = math.prod(shape[1:])
        shape[0] = row1 - row0
        return self._region(name, key, row0, row1, 0, row).reshape(shape)

    def read_flat(self, name: str, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of this rank's local tensor, flattened, as fp32. Across TP
        sizes: the range as (at most) a partial first row, whole rows and a partial last row, each read
        as exactly its part of every saved rank (``_region``)."""
        shape = self.local_shape(name)
        if numel <= 0:
            return torch.empty(0)
        same = self._same_rank(name)
        if same is not None or not shape:  # the same flat layout: exactly the range, from its pieces
            return self._saved_flat(same or 0, name, key, start, start + numel).float()
        row = math.prod(shape[1:])
        end = start + numel
        first, last = start // row, (end - 1) // row
        if first == last:
            rects = [(first, first + 1, start - first * row, end - first * row)]
        else:
            head, tail = start - first * row, end - last * row  # where the range starts and ends in a row
            rects = [(first, first + 1, head, row)] if head else []
            rects.append((first + (head > 0), last + (tail == row), 0, row))
            rects += [(last, last + 1, 0, tail)] if tail < row else []
        out = torch.empty(numel)
        at = 0
        for r0, r1, c0, c1 in rects:
            if r1 > r0 and c1 > c0:
                part = self._region(name, key, r0, r1, c0, c1).reshape(-1)
                out[at : at + part.numel()] = part
                at += part.numel()
                del part
        return out

    def read_local(self, name: str, key: str = "") -> torch.Tensor:
        """This rank's whole local tensor (its TP slice in the new layout)."""
        shape = self.local_shape(name)
        if not shape:
            return self.read_rows(name, key, 0, 1).float()
        return self.read_rows(name, key, 0, shape[0]).reshape(shape).float()


def _room_for(open_files: int) -> None:
    """Raise the soft limit on open files when a reader is about to pass it (an export of a 512-rank
    checkpoint holds 512 files open, each opened once); a hard limit below it is an error naming it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_files + 64  # what else the process has open
    if soft != resource.RLIM_INFINITY and need > soft:
        want = need * 2 if hard == resource.RLIM_INFINITY else min(hard, need * 2)
        if want < need:
            raise CheckpointError(
                f"reading this checkpoint needs {open_files} files open at once, more than this process may "
                f"open ({hard}: ulimit -n)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
