"""Whether the files a manifest lists are there, at the sizes it records: one stat per file, nothing read.

Why its own module: it is the check that takes seconds whatever the data set's size, and both
``goat-dist doctor`` and the start of training (``goat_dist.data.batches``) make it; it imports nothing
heavy, so the command line can load it without numpy. ``inspection`` reads and hashes every byte.
"""

from __future__ import annotations

import os
from pathlib import Path

SHARDS_NAMED = 3  # shard problems spelled out in one message; the rest are counted


def shard_file_problems(
    dataset_dir: str | os.PathLike, manifest: dict, splits: tuple[str, ...] | None = None
) -> list[str]:
    """Shards (of ``splits``, default every split) and their listed indexes that are missing or whose size
    on disk differs from the manifest's ``bytes``, one line each naming the file: one stat per file,
    nothing read, so a missing or truncated copy is found in seconds (``inspect`` reads and hashes)."""
    dataset_dir = Path(dataset_dir)
    problems = []
    for split, entries in manifest["splits"].items():
        if splits is not None and split not in splits:
            continue
        for e in entries:
            problem = _size_problem(dataset_dir / e["name"], e.get("bytes"), f"shard {e['name']}")
            if problem:
                problems.append(problem)
                continue
            index = e.get("index")
            if index:
                what = f"index {index['name']} of shard {e['name']}"
                problem = _size_problem(dataset_dir / index["name"], index.get("bytes"), what)
                if problem:
                    problems.append(problem)
    return problems


def summarize_problems(problems: list[str]) -> str:
    """The first ``SHARDS_NAMED`` problems spelled out, the rest counted: one line for any number."""
    more = len(problems) - SHARDS_NAMED
    return "; ".join(problems[:SHARDS_NAMED]) + (f"; and {more} more shard(s)" if more > 0 else "")


def _size_problem(path: Path, expected: int | None, what: str) -> str | None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        size = f" (the manifest lists {expected} bytes)" if expected is not None else ""
        return f"{what} is missing{size}"
    except OSError as err:
        return f"{what} cannot be read: {err}"
    if expected is not None and actual != expected:
        on_disk = f"{what} is {actual} bytes on disk"
        return f"{on_disk}, the manifest says {expected} bytes (truncated or changed copy?)"
    return None
