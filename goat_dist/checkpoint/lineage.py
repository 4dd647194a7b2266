"""Which checkpoints belong to the current run (its lineage), what ``checkpoint.keep_last`` prunes, and
what happens to checkpoints that do not belong.

Why: pruning used to keep the ``keep_last`` highest-numbered checkpoints in the directory. After a rollback
(``train.resume=<older step>``) or ``train.resume=never`` in an old run directory, leftovers with higher
step numbers took those slots and the new run's own checkpoints were deleted.

The lineage: every checkpoint records its parent (``lineage_parent`` in trainer_state.json): the
checkpoint the run resumed from or saved before it, or none. Pruning walks the parents from the newest
checkpoint and keeps the first ``keep_last``; nothing outside that chain is ever pruned. Checkpoints
written before parents were recorded count the next older complete checkpoint as their parent (what
pruning by step number assumed).

At start (rank 0), complete checkpoints newer than the run's starting point are stale: they belong to a
line of training this run has abandoned. They are moved to ``checkpoints/stale/`` (not deleted; the
user decides) with a message naming them, and ``latest`` is repointed if it named one of them. Moving
rather than refusing keeps a deliberate rollback a one-command operation.

A pinned start (``train.resume=<step dir>``): the pin is where the run begins, as torchtitan's
``initial_load_path`` and Megatron's ``--load`` work. Every checkpoint records its lineage's origin
(``lineage_origin``: the resolved pin that began it, inherited by every descendant). When the run dir's
``latest`` descends from the same pin, the run continues from it and nothing is moved: a forked run (or a
rollback) requeued by Slurm with the same overrides, after a preemption, an OOM or a lost node, goes on
from its own newest checkpoint instead of going back to the pin at every restart. A pin that began no
checkpoint of this run dir (a new fork, a rollback, checkpoints saved before origins were recorded) starts
from the pin, as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..atomic import atomic_write_text
from .names import LATEST, MANIFEST, STALE, STATE, step_of

PARENT = "lineage_parent"
ORIGIN = "lineage_origin"  # the train.resume pin this lineage began at (resolved), or None


def origin_of(pin: Path) -> str:
    """How a pin is recorded and compared: its resolved path (the same pin however it was spelled)."""
    return str(Path(pin).resolve())


def recorded_origin(step_dir: Path) -> str | None:
    """The pin the checkpoint ``step_dir``'s lineage began at (None: no pin, or not recorded)."""
    try:
        return json.loads((Path(step_dir) / STATE).read_text()).get(ORIGIN)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def continues_pin(pin: Path, own_latest: Path) -> bool:
    """Does this run dir's ``latest`` (a published checkpoint) descend from ``pin``, so that a run pinned
    there continues from it?"""
    return recorded_origin(own_latest) == origin_of(pin)


def complete_tags(root: Path) -> list[str]:
    return sorted(p.name for p in Path(root).glob("step_*") if (p / MANIFEST).is_file())


def parent_of(root: Path, tag: str, complete: list[str]) -> str | None:
    try:
        state = json.loads((Path(root) / tag / STATE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if PARENT in state:
        return state[PARENT]
    older = [t for t in complete if t < tag]  # written before lineages were recorded
    return older[-1] if older else None


def lineage(root: Path, newest: str) -> list[str]:
    """``newest`` and its complete ancestors in ``root``, newest first."""
    complete = complete_tags(root)
    chain, tag = [], newest
    while tag is not None and tag in complete and tag not in chain:
        chain.append(tag)
        tag = parent_of(root, tag, complete)
    return chain


def prune(root: Path, newest: str, keep_last: int) -> list[str]:
    """Delete this lineage's checkpoints beyond the newest ``keep_last``, and interrupted saves older than
    ``newest``. Returns the deleted tags."""
    removed = []
    if keep_last > 0:
        for old in lineage(root, newest)[keep_last:]:
            shutil.rmtree(Path(root) / old, ignore_errors=True)
            removed.append(old)
    for partial in Path(root).glob("step_*"):
        if not (partial / MANIFEST).is_file() and partial.name < newest:
            shutil.rmtree(partial, ignore_errors=True)
    return removed


def move_aside_newer(root: Path, start_step: int, start_tag: str | None) -> list[str]:
    """Move complete checkpoints newer than ``start_step`` to ``root/stale/``; repoint or remove ``latest``
    if it named one. ``start_tag``: the checkpoint this run resumed from when it is in ``root``."""
    root = Path(root)
    moved = []
    for tag in complete_tags(root):
        if step_of(tag) > start_step and tag != start_tag:
            target = root / STALE / tag
            n = 1
            while target.exists():
                target = root / STALE / f"{tag}.{n}"
                n += 1
            target.parent.mkdir(parents=True, exist_ok=True)
            (root / tag).rename(target)
            moved.append(tag)
    pointer = root / LATEST
    if moved and pointer.is_file() and pointer.read_text().strip() in moved:
        if start_tag is not None:
            atomic_write_text(pointer, start_tag)
        else:
            pointer.unlink()
    return moved
