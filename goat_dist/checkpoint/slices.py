"""Reading only the part of a universal checkpoint that one rank owns.

Why: a universal resume used to build the whole TP-merged fp32 model and both Adam moments on every rank
(~12 bytes per parameter per rank) and then keep its slice. Here a rank asks for a flat range of its
*local* tensor (its TP slice, in the new layout) and gets exactly that, read through safetensors'
``get_slice`` from the per-TP-rank files of the saved layout: extra memory is the rank's share plus at most
one row of padding on either side of each range.

How a TP split maps (megatron's ``partition_dim`` d and ``partition_stride`` s): along d the full tensor
is s blocks; block b is the concatenation over TP ranks of each rank's b-th chunk. A rank's local tensor
along d is, for every block, its own chunk. So a local index along d names (block, offset in block), the
offset names the saved rank and its local index: contiguous runs of those are read with one slice each.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError


def tensor_key(name: str, key: str) -> str:
    """The safetensors key of a parameter's value ("") or of one of its Adam moments."""
    return f"{name}::{key}" if key else name


class UniversalReader:
    """The universal state of one checkpoint, as seen by TP rank ``tp_rank`` of a TP=``tp`` layout.

    Two on-disk formats are read (``universal.py``): format 2, where every rank of the saved layout wrote
    its own flat pieces of its TP-local tensors (``meta.json`` lists each piece: TP rank, start, length,
    file), and format 1, one file per saved TP rank holding its whole TP-local tensors (a format-1 file
    is read as one piece per tensor, so both go through the same re-splitting)."""

    def __init__(self, step_dir: Path, tp: int, tp_rank: int):
        udir = Path(step_dir) / "universal"
        self.step_dir = Path(step_dir)
        self.meta = json.loads((udir / "meta.json").read_text())
        self.format = int(self.meta.get("format", 1))
        self.saved_tp = int(self.meta["tp"])
        self.tp, self.tp_rank = tp, tp_rank
        if self.format == 1:
            self.paths = [str(udir / f"tp{r:02d}.safetensors") for r in range(self.saved_tp)]
            with safe_open(self.paths[0], framework="pt") as f:
                self.shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        elif self.format == 2:
            self.paths = [str(udir / name) for name in self.meta["files"]]
            self.shapes = {name: list(m["shape"]) for name, m in self.meta["params"].items()}
            self.pieces = {
                name: sorted((int(r), int(s), int(n), int(f)) for r, s, n, f in pieces)
                for name, pieces in self.meta["pieces"].items()
            }
        else:
            raise CheckpointError(
                f"{self.step_dir}: universal/meta.json is format {self.format}; this goat-dist reads "
                "formats 1 and 2 (a newer goat-dist wrote it: upgrade to resume from it)"
            )

    def _open_slice(self, path: str, key: str, index) -> torch.Tensor:
        """``file[key][index]``, opening the file for this read only: while a safetensors file is open,
        the pages its memory map touched stay mapped and count in the process's RSS. One handle kept open
        over a whole ZeRO-3 DP=4 load held 0.6 of the checkpoint per rank; per read, 0.05."""
        with safe_open(path, framework="pt") as f:
            return f.get_slice(key)[index]

    def _saved_flat(self, rank: int, name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of saved TP rank ``rank``'s flattened local tensor (format 2): the pieces
        that overlap the range, each read with one slice of the file that holds it."""
        out, cursor, gap_end = [], lo, hi
        for r, start, numel, file in self.pieces.get(name, ()):
            if r != rank or start + numel <= cursor or start >= hi:
                continue
            if start > cursor:
                gap_end = start
                break
            end = min(hi, start + numel)
            key_name = tensor_key(name, key)
            out.append(self._open_slice(self.paths[file], key_name, slice(cursor - start, end - start)))
            cursor = end
            if cursor >= hi:
                break
        if cursor < hi:
            raise CheckpointError(
                f"{self.step_dir}: universal state lacks elements [{cursor}, {gap_end}) of "
                f"{tensor_key(name, key)} on saved TP rank {rank} (meta.json lists no piece holding them)"
            )
        return torch.cat(out) if len(out) > 1 else out[0]

    def _block(self, rank: int, name: str, key: str, index) -> torch.Tensor:
        """``saved local tensor of TP rank rank``[index]; ``index`` is ``...`` (a 0-d tensor) or a tuple whose
        first entry is a row slice (the rest slices the other dims)."""
        k = tensor_key(name, key)
        if self.format == 1:
            return self._open_slice(self.paths[rank], k, index)
        shape = self.shapes[name]
        if not shape:
            return self._saved_flat(rank, name, key, 0, 1).reshape(())
        rows = index[0]
        row = math.prod(shape[1:])
        r0, r1 = rows.start or 0, shape[0] if rows.stop is None else min(rows.stop, shape[0])
        block = self._saved_flat(rank, name, key, r0 * row, r1 * row).reshape(r1 - r0, *shape[1:])
        return block[(slice(None), *index[1:])] if len(index) > 1 else block

    def saved_local(self, rank: int, name: str, key: str = "") -> torch.Tensor:
        """Saved TP rank ``rank``'s whole local tensor (one-process tools: export, tests)."""
        shape = self.saved_shape(name, key)
        return self._block(rank, name, key, ... if not shape else (slice(0, shape[0]),)).reshape(shape)

    # ---- shapes ---------------------------------------------------------------------------------------
    def split_of(self, name: str) -> dict:
        try:
            return self.meta["params"][name]
        except KeyError:
            raise CheckpointError(f"{self.step_dir}: universal state has no parameter {name}") from None

    def _is_split(self, name: str) -> bool:
        return bool(self.split_of(name)["tp_split"]) and not (self.saved_tp == 1 and self.tp == 1)

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

    def read_rows(self, name: str, key: str, row0: int, row1: int) -> torch.Tensor:
        """Rows ``[row0, row1)`` (dim 0) of this rank's local tensor; a 0-d tensor whole."""
        if len(self.saved_shape(name)) == 0:
            return self._block(0, name, key, ...)
        if not self._is_split(name):
            return self._block(
                self.tp_rank if self.saved_tp == self.tp else 0, name, key, (slice(row0, row1),)
            )
        d = self.split_of(name)["dim"]
        local_len = self.local_shape(name)[d]
        pieces, cursor = [], 0
        for rank, a, z in self._runs(name, local_len):
            run_lo, run_hi = cursor, cursor + z - a  # where this run sits in the local tensor along d
            cursor = run_hi
            index = [slice(None)] * (d + 1)
            if d == 0:  # only the part of the run inside [row0, row1)
                lo, hi = max(row0, run_lo), min(row1, run_hi)
                if lo >= hi:
                    continue
                index[0] = slice(a + lo - run_lo, a + hi - run_lo)
            else:
                index[0] = slice(row0, row1)
                index[d] = slice(a, z)
            pieces.append(self._block(rank, name, key, tuple(index)))
        return torch.cat(pieces, dim=d)

    def read_flat(self, name: str, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of this rank's local tensor, flattened, as fp32."""
        shape = self.local_shape(name)
        if numel <= 0:
            return torch.empty(0)
        if not shape:
            return self.read_rows(name, key, 0, 1).reshape(-1).float()[start : start + numel]
        row = math.prod(shape[1:])
        row0, row1 = start // row, -(-(start + numel) // row)
        rows = self.read_rows(name, key, row0, row1).reshape(-1)
        offset = start - row0 * row
        return rows[offset : offset + numel].float()

    def read_local(self, name: str, key: str = "") -> torch.Tensor:
        """This rank's whole local tensor (its TP slice in the new layout)."""
        shape = self.local_shape(name)
        if not shape:
            return self.read_rows(name, key, 0, 1).float()
        return self.read_rows(name, key, 0, shape[0]).reshape(shape).float()
