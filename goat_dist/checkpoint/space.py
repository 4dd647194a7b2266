"""What a failed checkpoint write says: for a full disk (or quota), the directory and the bytes needed
and free.

Why: a full disk during a save ended the run with an OSError traceback (exit 1), although the cause is
the user's to fix (free space, or move ``run.dir``) and the previous checkpoint is intact. The message
is built on the rank whose write failed (where the bytes free are measured) and raised on every rank
as one CheckpointError (``digests.raise_everywhere``).
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
