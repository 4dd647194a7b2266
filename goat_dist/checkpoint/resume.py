"""Which checkpoint a run resumes from: decided on rank 0, broadcast, and checked on every rank.

Why: when every rank read ``checkpoints/latest`` on its own, ranks on nodes without a shared filesystem
(or with a stale NFS view) could pick different checkpoints, or none, and the job hung in the first
collective that disagreed. Here rank 0 alone reads ``latest`` (or takes ``train.resume=<path>``), every
rank receives rank 0's answer, and every rank checks that it can see that checkpoint. If one cannot, all
ranks stop with a CheckpointError naming the path and the ranks; no rank loads anything and none waits.

A checkpoint that no rank sees does not exist (a step pruned by ``checkpoint.keep_last``, a typo in
``train.resume=<path>``): the error says so and lists the complete checkpoints in that directory. The
advice to share run.dir between nodes is given only when some rank sees it and another does not.

The path travels as UTF-8 bytes in a tensor (no pickling between ranks). A relative path is resolved by
each rank against its own working directory, as the run directory is.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from .errors import CheckpointError
from .lineage import complete_tags
from .names import LATEST, MANIFEST, STALE, STATE, step_of


def broadcast_text(text: str | None) -> str | None:
    """Rank 0's ``text`` (or None) on every rank."""
    data = b"" if text is None else text.encode()
    header = torch.tensor([len(data), 0 if text is None else 1], dtype=torch.long)
    collectives.broadcast(header, src=0)
    if not header[1]:
        return None
    buffer = torch.zeros(int(header[0]), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    collectives.broadcast(buffer, src=0)
    return bytes(buffer.tolist()).decode()


def what_is_missing(step_dir: Path) -> str | None:
    """Why this rank cannot use ``step_dir`` (None when it can)."""
    if not step_dir.is_dir():
        return "the directory does not exist here"
    for name in (MANIFEST, STATE):
        if not (step_dir / name).is_file():
            return f"it has no {name} here"
    return None


def agree_on_checkpoint(choice: str, latest, key: str = "train.resume", pinned=None) -> Path | None:
    """Collective. ``choice``: ``train.resume`` (auto or a path; never is handled by the caller);
    ``latest``: a function giving this run dir's latest checkpoint, called on rank 0 only; ``pinned``: a
    function from the pinned path to the checkpoint to use (the run's own newest when it began at the pin;
    ``CheckpointManager._continue_pin``), on rank 0 only."""
    rank = dist.get_rank()
    mine = None
    if rank == 0:
        if choice == "auto":
            mine = latest()
        else:
            mine = Path(choice) if pinned is None else pinned(Path(choice))
    chosen = broadcast_text(None if mine is None else str(mine))
    if chosen is None:
        return None
    path = Path(chosen)
    problem = what_is_missing(path)
    flags = collectives.all_gather(torch.tensor([0 if problem is None else 1]))
    blind = [r for r, f in enumerate(flags) if f.item()]
    if not blind:
        return path
    own = choice == "auto" or path != Path(choice)
    source = "rank 0's checkpoints/latest" if own else f"{key}={choice}"
    if len(blind) == len(flags):  # no rank sees it: not a file system's doing
        raise CheckpointError(not_found(path, source, key))
    if problem is not None:
        raise CheckpointError(
            f"rank {rank} cannot see checkpoint {path} ({problem}; resolved from {Path.cwd()}), which "
            f"{source} names. Every rank must see the same checkpoint: put run.dir on a filesystem shared "
            "by all nodes, or copy the checkpoint to the same path on every node"
        )
    raise CheckpointError(
        f"rank(s) {blind} cannot see checkpoint {path}, which {source} names; no rank loaded anything. "
        "Every rank must see the same checkpoint: put run.dir on a filesystem shared by all nodes, or copy "
        "the checkpoint to the same path on every node"
    )


def _tags_text(tags: list[str], latest: str | None, most: int = 8) -> str:
    """``tags`` (oldest first) in one line, ``latest`` marked; a long list shortened in the middle."""
    named = [f"{t} (latest)" if t == latest else t for t in tags]
    if len(named) > most:
        named = [*named[:2], f"... {len(named) - most + 2} more ...", *named[-(most - 2) :]]
    return ", ".join(named)


def not_found(path: Path, source: str, key: str = "train.resume") -> str:
    """The message for a checkpoint that no rank sees: it does not exist (or is incomplete), and which
    complete checkpoints its directory holds."""
    folder = path.parent
    takes = f"{key} takes a checkpoint's step directory"
    if not path.exists():
        what = "does not exist"
    elif not path.is_dir():
        what = "is not a directory"
    elif (path / "checkpoints").is_dir():
        what, folder = f"is a run directory, not a checkpoint ({takes})", path / "checkpoints"
    elif complete_tags(path):
        what, folder = f"is a checkpoints directory, not a checkpoint ({takes})", path
    else:
        missing = MANIFEST if not (path / MANIFEST).is_file() else STATE
        what = f"is not a complete checkpoint (it has no {missing}: an interrupted save?)"
    where = "" if path.is_absolute() else f" (resolved from {Path.cwd()})"
    message = f"checkpoint {path}, which {source} names, {what}{where}"
    if not folder.is_dir():
        return f"{message}; {folder} does not exist either"
    tags = complete_tags(folder)
    if not tags:
        message += f"; {folder} holds no complete checkpoint"
    else:
        try:
            latest = (folder / LATEST).read_text().strip() or None
        except OSError:
            latest = None
        message += f"; the checkpoints in {folder}: {_tags_text(tags, latest)}"
        if path.parent == folder and path.name.startswith("step_"):
            try:
                older = step_of(path.name) < step_of(tags[0])
            except ValueError:
                older = False
            if older:
                message += " (older ones are pruned: checkpoint.keep_last keeps the newest)"
    stale = complete_tags(folder / STALE)
    if stale:
        message += f"; moved aside in {folder / STALE}: {_tags_text(stale, None)}"
    return message + (f". Set {key} to one of them" if tags or stale else "")
