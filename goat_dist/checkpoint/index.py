"""``universal/index.json``: which saved file holds which flat range of each (parameter, TP rank).

Each parameter's pieces are given by a rule where one gives them exactly (``slices.py`` reads them):

- ``even`` (ZeRO-3): replica i holds ``[i * size, (i + 1) * size)``, the last short or empty;
- ``share`` (the replicated layouts: every replica an even part of every tensor): ``share``;
- ``flat`` (ZeRO-1/2: a flat group's partitions hold the parameter on a run of consecutive replicas):
  ``[i0, head, part]``, ``flat_spans``;

else its pieces are listed (``[TP rank, start, numel, file]``). The files are named by rule too
(``file_name(rank)``), and placed by one (``tp_inner``: TP rank t's replica i is global rank
``i * tp + t``), so the index is O(parameters), whatever the world.

Why agree instead of gather: rank 0 used to receive every rank's piece list inside the save's pause to
find the rules (at 30B on 512 ranks, ~493k pieces) and then wrote a file that does not depend on them. Now
``agree`` finds every rule with three all-reduces of O(parameters) integers: where each parameter starts
(the replica and its elements there), what the next replica holds, then whether every rank's own pieces
are what each candidate rule says (each rank checks only its own). Only if some parameter has no rule, or
a rank is not where ``tp_inner`` puts it, are the lists gathered (``index_record``), as before; both ways
write the same index.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..atomic import atomic_write_text

__all__ = [
    "INDEX",
    "agree",
    "file_name",
    "flat_spans",
    "index_record",
    "rules_record",
    "share",
    "span",
    "write_index",
    "write_rules",
]

FORMAT = 3
INDEX = "index.json"


def file_name(rank: int) -> str:
    """The state file global rank ``rank`` writes, inside ``universal/``."""
    return f"rank{rank:05d}.safetensors"


def flat_spans(rule: list, numel: int, first: int = 0, last: int | None = None) -> dict[int, tuple[int, int]]:
    """{replica: (start, numel)} of a ZeRO-1/2 parameter of ``numel`` elements under the index's ``flat``
    rule ``[i0, head, part]``: its flat group's partitions hold it on consecutive replicas from ``i0``,
    the first ``head`` elements, each next one ``part`` more (the last what is left); only the replicas in
    ``[first, last)`` (None: all)."""
    i0, head, part = (int(v) for v in rule)
    count = 1 + (-(-(numel - head) // part) if numel > head else 0)
    out = {}
    for i in range(max(first, i0), i0 + count if last is None else min(last, i0 + count)):
        a = 0 if i == i0 else head + (i - i0 - 1) * part
        z = head if i == i0 else min(numel, head + (i - i0) * part)
        out[i] = (a, z - a)
    return out


def share(start: int, numel: int, index: int, count: int) -> tuple[int, int]:
    """Replica ``index`` of ``count``'s even part of the flat range ``[start, start + numel)``."""
    lo, hi = numel * index // count, numel * (index + 1) // count
    return start + lo, hi - lo


def _candidates(numel: int, replicas: int, i0: int, head: int, part: int) -> list[dict]:
    """The rules worth trying for a parameter of ``numel`` elements whose first elements (``head`` of them)
    are held by replica ``i0`` (-1: none), and the next replica ``part`` (-1: none), in the order tried."""
    rules: list[dict] = []
    if i0 == 0 and head > 0:
        rules.append({"even": head})
    rules.append({"share": replicas})
    if i0 >= 0:
        rules.append({"flat": [i0, head, part if part > 0 else max(numel - head, 1)]})
    return rules


def span(rule: dict, numel: int, replicas: int, i: int) -> tuple[int, int] | None:
    """(start, numel) of what replica ``i`` holds of the parameter under ``rule``; None: nothing."""
    if "even" in rule:
        size = int(rule["even"])
        start, count = i * size, min(numel, (i + 1) * size) - i * size
    elif "share" in rule:
        start, count = share(0, numel, i, replicas)
    else:
        start, count = flat_spans(rule["flat"], numel, i, i + 1).get(i, (0, 0))
    return (start, count) if count > 0 else None


def _fit(pieces: dict[int, dict[int, tuple[int, int]]], numel: int, tp: int, replicas: int) -> dict | None:
    """The first rule that gives exactly ``pieces`` ({TP rank: {replica: (start, numel)}}, empty ones left
    out) on every TP rank, or None (its pieces are listed)."""
    own = pieces.get(0, {})
    i0 = next((i for i, (start, _) in sorted(own.items()) if start == 0), -1)
    head = own[i0][1] if i0 >= 0 else -1
    part = own.get(i0 + 1, (0, -1))[1] if i0 >= 0 else -1
    for rule in _candidates(numel, replicas, i0, head, part):
        want = {i: held for i in range(replicas) if (held := span(rule, numel, replicas, i)) is not None}
        if all(pieces.get(t, {}) == want for t in range(tp)):
            return rule
    return None


def _head(params: dict, tp: int, saved: dict, world: int, replicas: int) -> dict:
    return {"format": FORMAT, "tp": tp, **saved, "params": params, "world": world, "replicas": replicas}


def index_record(params: dict, gathered: list, tp: int, saved: dict) -> dict:
    """``index.json`` from every rank's piece list (``gathered[rank]``: its file, TP rank, replica index
    and pieces) and the counters: a rule per parameter where one fits, else its pieces listed, and a
    ``grid`` of files by (TP rank, replica), a rule where one fits."""
    files: list[str] = []
    table: dict[str, list] = {name: [] for name in params}
    for i, part in enumerate(gathered):
        files.append(part["file"])
        for name, start, numel in part["pieces"]:
            table[name].append([part["tp"], start, numel, i])
    replicas = 1 + max(int(part.get("replica", 0)) for part in gathered)
    grid: list | None = [[None] * replicas for _ in range(tp)]
    for i, part in enumerate(gathered):
        t, r = int(part["tp"]), int(part.get("replica", 0))
        if grid is None or grid[t][r] is not None:
            grid = None  # two ranks claim one place: list every piece
        else:
            grid[t][r] = i
    if grid is not None and any(f is None for row in grid for f in row):
        grid = None
    compact = {}
    for name, m in params.items():
        rule = None
        if grid is not None:
            by_place: dict[int, dict[int, tuple[int, int]]] = {}
            for t, start, numel, f in table[name]:
                by_place.setdefault(t, {})[int(gathered[f].get("replica", 0))] = (start, numel)
            rule = _fit(by_place, math.prod(m["shape"]), tp, replicas)
        compact[name] = rule if rule is not None else table[name]
    record = _head(params, tp, saved, len(files), replicas)
    if files != [file_name(r) for r in range(len(files))]:
        record["files"] = files
    tp_inner = grid is not None and all(
        f == i * tp + t for t, row in enumerate(grid) for i, f in enumerate(row)
    )
    return {**record, "grid": {"tp_inner": True} if tp_inner else grid, "pieces": compact}


def rules_record(params: dict, rules: dict, tp: int, replicas: int, saved: dict) -> dict:
    """``index.json`` from agreed ``rules`` (``agree``): what ``index_record`` writes from the lists."""
    return {**_head(params, tp, saved, tp * replicas, replicas), "grid": {"tp_inner": True}, "pieces": rules}


def _write(out: Path, record: dict) -> None:
    atomic_write_text(Path(out) / INDEX, json.dumps(record, separators=(",", ":")))


def write_index(out: Path, params: dict, gathered: list, tp: int, saved: dict) -> None:
    """Rank 0: ``universal/index.json`` from the gathered lists (``index_record``)."""
    _write(out, index_record(params, gathered, tp, saved))


def write_rules(out: Path, params: dict, rules: dict, tp: int, replicas: int, saved: dict) -> None:
    """Rank 0: ``universal/index.json`` from agreed rules (``rules_record``)."""
    _write(out, rules_record(params, rules, tp, replicas, saved))


def agree(
    params: dict, pieces: list[tuple[str, int, int]], replica: int, replicas: int, placed: bool, reduce
):
    """Collective (``reduce(tensor, op)``: an all-reduce over the world, op "max" or "min"): every
    parameter's rule, or None on every rank when some parameter has none or some rank is not where
    ``tp_inner`` places it (``placed``: this one is). ``pieces``: this rank's (name, start, numel); its
    replica index ``replica`` of ``replicas``. Three all-reduces of ~3 x parameters integers."""
    names = list(params)
    n = len(names)
    mine: dict[str, tuple[int, int]] = {}
    for name, start, numel in pieces:
        if name in mine or name not in params:
            placed = False  # two pieces of one parameter (or an unknown one): not a layout the rules know
        mine[name] = (start, numel)
    first = torch.full((2 * n + 1,), -1, dtype=torch.int64)
    for j, name in enumerate(names):
        held = mine.get(name)
        if held is not None and held[0] == 0 and held[1] > 0:
            first[j], first[n + j] = replica, held[1]
    first[2 * n] = 0 if placed else 1
    reduce(first, "max")  # where each parameter starts: its replica and the elements it holds there
    if int(first[2 * n]) > 0:
        return None
    after = torch.full((max(n, 1),), -1, dtype=torch.int64)
    for j, name in enumerate(names):
        held = mine.get(name)
        if held is not None and int(first[j]) >= 0 and replica == int(first[j]) + 1:
            after[j] = held[1]
    reduce(after, "max")  # what the replica after the start holds
    tried: list[list[dict]] = []
    fits = torch.zeros((3 * max(n, 1),), dtype=torch.int64)
    for j, name in enumerate(names):
        numel = math.prod(params[name]["shape"])
        rules = _candidates(numel, replicas, int(first[j]), int(first[n + j]), int(after[j]))
        tried.append(rules)
        for k, rule in enumerate(rules):
            fits[3 * j + k] = int(span(rule, numel, replicas, replica) == mine.get(name))
    reduce(fits, "min")  # a rule fits where it gives every rank exactly its own pieces
    agreed = {}
    for j, name in enumerate(names):
        fitting = [rule for k, rule in enumerate(tried[j]) if int(fits[3 * j + k])]
        if not fitting:
            return None
        agreed[name] = fitting[0]
    return agreed
