"""A checkpoint's manifest: every file's size and sha256, split so that a rank reads only what it opens.

Why: a manifest listing every file makes every rank of a resume read every rank's digests (~400 bytes per
rank: 200 KB at 512 ranks, read 512 times at each requeue), so the per-rank cost grows with the world.
Instead the files each rank writes (``universal/rank<R>.safetensors``, ``rng_rank<R>.pt``) are listed in
parts of ``RANKS_PER_PART`` ranks, ``digests/ranks_<first rank>.json``; ``manifest.json`` lists the run
files (run state, config, index) and says how many parts there are. A rank reads ``manifest.json`` and the
parts that hold the files it opens: on the layout that saved it, one part (its own files), whatever the
world. Both stay O(1) in the world: the top names no part, the parts hold a fixed number of ranks.

Checks: each part carries the sha256 of its listing and the save's id (``save``: random, in the top
manifest too), so a corrupt part, or one left by another save, is a CheckpointError naming it; the top
records the sha256 of all parts' digests in order, so ``verify`` (which reads every part) also finds one
missing or swapped. Rank 0 writes the parts, then the top last: a checkpoint without ``manifest.json`` is
incomplete, as before. A manifest of an earlier release (every file in ``files``) is read as it is.

``read`` returns a dict whose ``files`` is a ``Files`` mapping: looking a name up reads (once) the part
that holds it; iterating or ``len`` reads every part (whole-checkpoint tools: verify, inspect).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..atomic import atomic_write_text
from .errors import CheckpointError
from .names import MANIFEST

__all__ = ["PARTS", "RANKS_PER_PART", "Files", "Manifest", "rank_of", "read", "write"]

PARTS = "digests"  # the directory of the parts, inside the step directory
RANKS_PER_PART = 8  # one node of 8 GPUs: a part is ~3 KB, and a rank reads 1 on the layout that saved it
_RANK_FILE = re.compile(r"^(?:universal/rank(\d+)\.safetensors|rng_rank(\d+)\.pt)$")


def rank_of(name: str) -> int | None:
    """The rank that wrote ``name`` when it is one rank's file (listed in a part), else None."""
    found = _RANK_FILE.match(name)
    return None if found is None else int(found.group(1) or found.group(2))


def part_name(index: int, per_part: int = RANKS_PER_PART) -> str:
    return f"{PARTS}/ranks_{index * per_part:06d}.json"


def _digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write(step_dir: Path, files: dict[str, dict], extra: dict) -> None:
    """Rank 0: the parts, then ``manifest.json`` (each atomically). ``files``: {name: {bytes, sha256, ...}}
    of every file of the checkpoint (``digests.digest_files``); ``extra``: the top's other keys (step)."""
    step_dir = Path(step_dir)
    save = secrets.token_hex(8)
    top: dict[str, dict] = {}
    parts: dict[int, dict[str, dict]] = {}
    for name, meta in files.items():
        rank = rank_of(name)
        if rank is None:
            top[name] = meta
        else:
            parts.setdefault(rank // RANKS_PER_PART, {})[name] = meta
    count = 1 + max(parts) if parts else 0
    digests = []
    if count:
        (step_dir / PARTS).mkdir(exist_ok=True)
    for index in range(count):
        listed = parts.get(index, {})
        digests.append(_digest(listed))
        record = {"save": save, "step": extra.get("step"), "files": listed, "sha256": digests[-1]}
        atomic_write_text(step_dir / part_name(index), json.dumps(record, separators=(",", ":")))
    ranks = {"per_part": RANKS_PER_PART, "parts": count, "sha256": _digest({"parts": digests})}
    atomic_write_text(
        step_dir / MANIFEST, json.dumps({"files": top, **extra, "save": save, "ranks": ranks}, indent=1)
    )


class Files(Mapping):
    """{name: {bytes, sha256, ...}} of a checkpoint's files; a rank's file is looked up in its part, read
    and checked when first needed (module docstring)."""

    def __init__(self, step_dir: Path, top: dict, ranks: dict | None, save: str | None, step):
        self.step_dir, self.top, self.ranks, self.save, self.step = Path(step_dir), top, ranks, save, step
        self.per_part = int(ranks.get("per_part", RANKS_PER_PART)) if ranks else RANKS_PER_PART
        self._parts: dict[int, dict] = {}

    def _where(self) -> str:
        return f"checkpoint {self.step_dir} (step {self.step}): "

    def part(self, index: int) -> dict:
        """Part ``index``'s listing, read and checked once."""
        if index not in self._parts:
            name, first = part_name(index, self.per_part), index * self.per_part
            at = f"{self._where()}{name} (the digests of ranks {first}-{first + self.per_part - 1}'s files)"
            try:
                record = json.loads((self.step_dir / name).read_bytes())
            except FileNotFoundError:
                raise CheckpointError(f"{at} is missing") from None
            except OSError as e:
                raise CheckpointError(f"{at} cannot be read: {e.strerror or e}") from None
            except ValueError as e:
                raise CheckpointError(f"{at} is not valid JSON: {e}") from None
            listed = record.get("files") if isinstance(record, dict) else None
            if not isinstance(listed, dict) or _digest(listed) != record.get("sha256"):
                raise CheckpointError(f"{at} does not match its sha256")
            if record.get("save") != self.save:
                raise CheckpointError(f"{at} belongs to another save than its {MANIFEST}")
            self._parts[index] = listed
        return self._parts[index]

    def parts_read(self) -> list[str]:
        """The parts read so far (what a rank's lookups cost it)."""
        return [part_name(i, self.per_part) for i in sorted(self._parts)]

    def _count(self) -> int:
        return int(self.ranks["parts"]) if self.ranks else 0

    def __getitem__(self, name: str) -> dict:
        if name in self.top:
            return self.top[name]
        rank = rank_of(name)
        if rank is None or rank // self.per_part >= self._count():
            raise KeyError(name)
        return self.part(rank // self.per_part)[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.top
        for index in range(self._count()):
            yield from self.part(index)

    def __len__(self) -> int:
        return len(self.top) + sum(len(self.part(i)) for i in range(self._count()))

    def check_parts(self) -> None:
        """Read every part and check that together they are the ones the top manifest records."""
        digests = [_digest(self.part(i)) for i in range(self._count())]
        if self.ranks and _digest({"parts": digests}) != self.ranks.get("sha256"):
            raise CheckpointError(
                f"{self._where()}its {PARTS}/ parts are not the ones its {MANIFEST} records"
            )


class Manifest(dict):
    """The top manifest's keys, ``files`` a ``Files``; ``fingerprint``: the sha256 of ``manifest.json``'s
    bytes (ranks that read different ones are on different file systems)."""

    fingerprint: str = ""


def read(step_dir: Path) -> Manifest:
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {step_dir} is incomplete: no {MANIFEST} (interrupted save?)"
        ) from None
    try:
        top = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(top, dict) or not isinstance(top.get("files"), dict):
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST} has no 'files' listing")
    manifest = Manifest(top)
    manifest["files"] = Files(step_dir, top["files"], top.get("ranks"), top.get("save"), top.get("step"))
    manifest.fingerprint = hashlib.sha256(raw).hexdigest()
    return manifest
