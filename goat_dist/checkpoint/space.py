"""What a failed checkpoint write says: for a full disk (or quota), the directory and the bytes needed
and free.

Why: a full disk during a save ended the run with an OSError traceback (exit 1), although the cause is
the user's to fix (free space, or move ``run.dir``) and the previous checkpoint is intact. The message
is built on the rank whose write failed (where the bytes free are measured) and raised on every rank
as one CheckpointError (``digests.raise_everywhere``).

At start (``room_at_start``, through ``CheckpointManager.check_room``) the same comparison is made before
any work: a disk without room for one checkpoint stops the run at once (the error names run.dir, the
bytes needed and free); one without room for what ``checkpoint.keep_last`` keeps is a warning.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the file system holding ``path`` (its nearest existing parent)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def write_failure(
    path: Path,
    step_dir: Path,
    error: BaseException,
    previous_bytes: int | None = None,
    latest: str | None = None,
) -> str:
    """The message for a failed write of ``path`` (a file of the checkpoint ``step_dir``).

    ``error.needed_bytes``, when the writer set it, is the size of the file it was writing;
    ``previous_bytes`` the size of the last published checkpoint, ``latest`` its tag."""
    path, step_dir = Path(path), Path(step_dir)
    try:
        name = str(path.relative_to(step_dir))
    except ValueError:
        name = path.name
    failed = f"checkpoint {step_dir}: writing {name} failed: {type(error).__name__}: {error}"
    if not is_disk_full(error):
        return failed
    figures = []
    needed = getattr(error, "needed_bytes", None)
    if needed:
        figures.append(f"{name} needs {needed:,} bytes")
    if previous_bytes:
        figures.append(f"the last checkpoint took {previous_bytes:,} bytes")
    free = free_bytes(path.parent)
    if free is not None:
        figures.append(f"{free:,} bytes are free")
    kept = f"{latest} stays `latest`, intact" if latest else "no earlier checkpoint of this run exists"
    return (
        f"{failed}. The disk holding {path.parent} is full"
        + (f" ({'; '.join(figures)})" if figures else "")
        + f": {step_dir.name} is not saved and its partial files are removed; {kept}. Free space there "
        "(or move run.dir), then resume"
    )


def _size(n: int) -> str:
    """``12,345,678 bytes (12.3 MB)``."""
    value, unit = float(n), "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{n:,} bytes" + ("" if unit == "B" else f" ({value:.1f} {unit})")


def checkpoints_to_come(keep_last: int, kept: int, saves: int | None) -> int | None:
    """How many more checkpoints the run needs room for at its peak. ``kept``: this run's lineage already
    on disk; ``saves``: the saves this run makes (None: no bound known, as with time-based saves).

    With ``keep_last`` K the lineage holds K, and a save writes the next one before the oldest is pruned:
    K + 1 at once (fewer when the run saves less). ``keep_last=0`` keeps every one. None: no bound."""
    if saves == 0:
        return 0
    if keep_last <= 0:
        return saves
    peak = keep_last + 1 if saves is None else min(keep_last + 1, kept + saves)
    return max(peak - kept, 1)


def room_at_start(
    run_dir: Path, root: Path, need: int, keep_last: int, kept: int, saves: int | None
) -> tuple[str, str]:
    """(error, warning) for a run about to write checkpoints of ``need`` bytes each into ``root`` (its
    run dir's checkpoints/, which may not exist yet): an error when one does not fit in the bytes free,
    a warning when what ``checkpoint.keep_last`` keeps does not; empty strings when all fits."""
    free = free_bytes(root)
    if free is None or need <= 0:
        return "", ""
    where = f"run.dir={run_dir}"
    if free < need:
        return (
            f"{where}: no room for one checkpoint: it needs ~{_size(need)} and {_size(free)} are free "
            f"there. Free space there or move run.dir; the run stopped before training"
        ), ""
    more = checkpoints_to_come(keep_last, kept, saves)
    if more is None or more * need <= free:
        return "", ""
    held = (
        f"keep_last={keep_last} keeps {keep_last}, and a save writes the next before the oldest is pruned"
        if keep_last > 0
        else f"keep_last=0 keeps every one, and this run saves {saves}"
    )
    return "", (
        f"warning: {where}: room for {free // need} checkpoint(s) of ~{_size(need)} ({_size(free)} free), "
        f"and this run needs room for {more} more (checkpoint.{held}; {kept} on disk now). The save that "
        "finds the disk full stops the run (the previous checkpoint stays intact): free space, lower "
        "checkpoint.keep_last, or move run.dir"
    )
