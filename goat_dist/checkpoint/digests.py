"""A checkpoint's file digests (the manifest's sizes and sha256), computed by every rank in parallel.

Why: hashing every file of every rank on rank 0 alone reads the whole checkpoint through one process
(~110 GB at 7B) while every other rank waits in a barrier, long enough to risk a collective timeout.
Instead:

- Saving (``digest_files``): every rank hashes the files it wrote as it writes them (``tensor_file``, the
  background writer of an async save) and passes those digests as ``known``; so the hashing is balanced as
  the writes are (each rank ~1/world of the state). Rank 0 lists the directory and broadcasts the list;
  anything not yet hashed (the small run files) is shared out (``shares``: deterministic, balanced by
  bytes, largest files first); rank 0 alone receives every digest (``gather_object``), and writes the
  manifest: the run files in ``manifest.json``, each rank's files in a part of a few ranks
  (``manifest.py``).
- Loading: every rank reads the top manifest and the parts listing the files it opens, and checks what it
  reads and nothing else (``read_checked`` for the small files, block
  checksums for the state: ``slices``), so a resume stats and hashes the rank's share, not the world's.
  A problem found on any rank is raised on every rank with the same message, naming the file and the step
  (``raise_everywhere``), so all ranks stop together. ``verify`` checks a whole checkpoint (``goat-dist
  ckpt verify``, ``inspect``): every size, and the checksums in shares when given a process group.

Without a process group (``goat-dist ckpt inspect``, export, tools) everything runs in the one process.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from ..atomic import file_problem, sha256_file
from . import manifest as manifest_file
from .errors import CheckpointError
from .manifest import PARTS, Manifest
from .names import MANIFEST

__all__ = [
    "any_rank",
    "digest_files",
    "gather",
    "listing",
    "raise_everywhere",
    "read_checked",
    "reduce",
    "same_everywhere",
    "shares",
    "verify",
]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Split files over ``world`` ranks, balanced by bytes: largest first, each to the rank with the fewest
    bytes so far (ties: the lower rank). The same input gives the same split on every rank."""
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[rank].append(name)
        load[rank] += sizes[name]
    return out


def listing(step_dir: Path) -> dict[str, int]:
    """Every file of a checkpoint but its manifest (and the manifest's parts): relative name -> bytes."""
    step_dir = Path(step_dir)
    return {
        str(p.relative_to(step_dir)): p.stat().st_size
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST and p.relative_to(step_dir).parts[0] != PARTS
    }


def digest(path: Path) -> dict:
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def gather(obj) -> list:
    """Every rank's ``obj`` (collective; ``[obj]`` in one process without a group)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    return collectives.all_gather_object(obj)


def _raise_first(errors: list[str]) -> None:
    """Raise the lowest failing rank's error (the same message on every rank that saw the same list)."""
    for rank, found in enumerate(errors):
        if found:
            raise CheckpointError(found + (f" (found on rank {rank})" if len(errors) > 1 else ""))


def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Collective: ``tensor`` all-reduced in place over the world (``op``: max or min); as it is in one
    process. A host tensor: ``collectives`` places it where the backend takes it (NCCL: the device)."""
    if _world()[1] > 1:
        collectives.all_reduce(tensor, op)
    return tensor


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is set on any rank (one 1-element all-reduce)."""
    return bool(reduce(torch.tensor([1 if flag else 0], dtype=torch.int64), "max").item())


def raise_everywhere(error: str) -> None:
    """Collective: if any rank found an ``error``, every rank raises the same CheckpointError (the lowest
    failing rank's message), so all stop together and none loads a partial checkpoint or hangs later.
    Without one, a 1-element all-reduce is all: the messages are gathered only when there is one, so no
    rank receives the world's on the way that succeeds."""
    if any_rank(bool(error)):
        _raise_first(gather(error or ""))


def same_everywhere(fingerprint: str) -> bool:
    """Collective: whether every rank holds the same ``fingerprint`` (a hex digest), by its first 60 bits
    in one 2-element all-reduce (max of h and of -h: equal when the least is the most)."""
    h = int(fingerprint[:15] or "0", 16)
    bounds = reduce(torch.tensor([h, -h], dtype=torch.int64), "max")
    return int(bounds[0]) == -int(bounds[1])


def _to_first(obj) -> list:
    """Every rank's ``obj`` on rank 0 (collective; ``[]`` elsewhere, ``[obj]`` without a group)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    return collectives.gather_object(obj, dst=0) or []


def digest_files(step_dir: Path, known: dict | None = None, error: str = "") -> dict[str, dict]:
    """Collective (or one process without a group): on rank 0, ``{name: {"bytes", "sha256"}}`` of every
    file of ``step_dir`` but the manifest, each file hashed by one rank; ``{}`` on the others (only rank 0
    writes the manifest, so no rank receives the world's digests but rank 0). ``known``: digests this rank
    already computed (its own files, hashed right after writing); ``error``: a failure this rank had while
    writing. Any rank's error, or a file that changed size after it was hashed, is raised on every rank."""
    step_dir = Path(step_dir)
    rank, world = _world()
    raise_everywhere(error)  # a writer failed somewhere: the same message everywhere
    merged: dict[str, dict] = {}
    for part in _to_first(known or {}):
        merged.update(part)
    plan: list = [None]
    names: list[str] = []
    if rank == 0:
        try:
            sizes = listing(step_dir)
            problem = ""
            for name, meta in merged.items():
                if sizes.get(name) != meta["bytes"]:
                    problem = (
                        f"checkpoint {step_dir}: {name} has {sizes.get(name)} bytes on rank 0 but "
                        f"{meta['bytes']} when its writer hashed it"
                    )
                    break
        except OSError as e:
            sizes, problem = {}, f"checkpoint {step_dir}: cannot list it on rank 0: {e}"
        todo = {n: s for n, s in sizes.items() if n not in merged}
        names = sorted(sizes)
        assigned = {r: part for r, part in enumerate(shares(todo, world)) if part}  # the few run files
        plan = [(assigned, problem)]
    if world > 1:
        collectives.broadcast_object_list(plan, src=0)
    assigned, problem = plan[0]
    results, error = {}, problem if rank == 0 else ""
    for name in assigned.get(rank, []) if not problem else []:
        try:
            results[name] = digest(step_dir / name)
        except OSError as e:
            error = f"checkpoint {step_dir}: rank {rank} cannot read {name} to hash it: {e}"
            break
    raise_everywhere(error)
    for part in _to_first(results):
        merged.update(part)
    return {name: merged[name] for name in names}


def read_manifest(step_dir: Path) -> Manifest:
    """The checkpoint's manifest; a rank's files' digests are read from their part when looked up
    (``manifest.py``)."""
    return manifest_file.read(step_dir)


def where(step_dir: Path, manifest: dict | None) -> str:
    """How an error names a checkpoint (and its step, when the manifest is known)."""
    step = f" (step {manifest.get('step')})" if manifest else ""
    return f"checkpoint {step_dir}{step}: "


def read_checked(step_dir: Path, name: str, manifest: dict | None = None) -> bytes:
    """The bytes of ``name`` (relative to ``step_dir``), read once and checked against the manifest's size
    and sha256 (without a manifest: as they are). A problem is a CheckpointError naming the file."""
    step_dir = Path(step_dir)
    at = where(step_dir, manifest)
    expect = None
    if manifest is not None:
        expect = manifest["files"].get(name)
        if expect is None:
            raise CheckpointError(f"{at}{name} is not in its {MANIFEST}")
    try:
        data = (step_dir / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{at}{name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{at}{name} cannot be read: {e.strerror or e}") from None
    if expect is not None:
        if len(data) != int(expect["bytes"]):
            raise CheckpointError(
                f"{at}{name} has {len(data)} bytes, expected {expect['bytes']} (truncated?)"
            )
        if hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise CheckpointError(f"{at}{name} does not match its sha256")
    return data


def _problem(step_dir: Path, manifest: dict, checksums: set[str] | bool) -> str:
    """The first thing wrong with the files against the manifest: every size; checksums of ``checksums``
    (a set of names, or all/none)."""
    for name, meta in manifest["files"].items():
        hashed = checksums if isinstance(checksums, bool) else name in checksums
        problem = file_problem(step_dir / name, meta["bytes"], meta["sha256"], checksums=hashed, name=name)
        if problem:
            return f"checkpoint {step_dir} (step {manifest.get('step')}): {problem}"
    return ""


def verify(step_dir: Path, checksums: bool = True, parallel: bool = False) -> dict:
    """The manifest of a complete, intact checkpoint; raises CheckpointError naming what is wrong.

    ``parallel=True`` is a collective over the default process group: every rank checks every size and
    hashes its share of the files (``shares``); a problem on any rank is raised on every rank. Otherwise
    (one process, no group needed) this process checks everything."""
    step_dir = Path(step_dir)
    rank, world = _world()
    if not parallel or world == 1:
        manifest = read_manifest(step_dir)
        problem = _problem(step_dir, manifest, checksums)
        if problem:
            raise CheckpointError(problem)
        manifest["files"].check_parts()
        return manifest
    found: Manifest | None = None
    error, fingerprint = "", ""
    try:
        found = manifest = read_manifest(step_dir)
        fingerprint = manifest.fingerprint
        manifest["files"].check_parts()
        mine: set[str] | bool = False
        if checksums:
            sizes = {n: m["bytes"] for n, m in manifest["files"].items()}
            mine = set(shares(sizes, world)[rank])
        error = _problem(step_dir, manifest, mine)
    except CheckpointError as e:
        error = str(e)
    raise_everywhere(error)
    if not same_everywhere(fingerprint):
        raise CheckpointError(
            f"checkpoint {step_dir}: the ranks read different {MANIFEST} files (is run.dir on a file "
            "system every node shares?)"
        )
    assert found is not None  # else this rank's error was raised above
    return found
