"""Restart bookkeeping of `prepare`: which shards an interrupted run already finished, and which files
in its output directory are its own.

Why: tokenizing a large corpus takes hours; a crash or preemption must not cost the finished
shards. `.prepare-progress.json` (written atomically) is the first file a prepare writes into its
output directory and the last it removes. After each shard is committed it records the shard's
manifest entry and `end_doc`, the number of input documents read when it was closed: every document of
that split with a smaller index is in a finished shard. Before a shard (and its index) is begun, its
name is recorded under "claimed", so a shard committed just before a crash, not yet in "splits", is
still known to be this tool's. "stale" lists the files of a data set being replaced (`--overwrite`)
until they are removed.

A re-run with the same arguments (same fingerprint) checks the recorded shards (size, sha256), keeps
the valid prefix of each split and tokenizes only what comes after it; the output is byte-identical to
an uninterrupted run. A record of other arguments is never acted on silently: `prepare` refuses, or
with `--restart` removes exactly the files the record lists (`discard`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from data_tools.shard_format import MANIFEST_NAME, index_name, shard_name
from goat_dist.atomic import atomic_write_text, file_problem

PROGRESS_NAME = ".prepare-progress.json"
log = logging.getLogger("data_tools")
# goat_dist.atomic.temp_path_for's names: `.<name>.<8 random characters>.tmp`
_TEMP = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp")


class PrepareError(RuntimeError):
    """The output directory can't be (re)used as asked; the message names it, and nothing was changed."""


def _check_name(name: object, where: Path) -> str:
    """`name` when it is a plain file name (a record never points outside its directory)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise PrepareError(f"{where} lists {name!r}, no file name in its directory; nothing was changed")
    return name


def entry_files(entries: Iterable[dict], where: Path) -> list[str]:
    """The shard and index file names of manifest/progress entries."""
    names = []
    for e in entries:
        if not isinstance(e, dict):
            raise PrepareError(f"{where} holds a shard entry that is no object: {e!r}; nothing was changed")
        names.append(_check_name(e.get("name"), where))
        if isinstance(e.get("index"), dict):
            names.append(_check_name(e["index"].get("name"), where))
    return names


def read_record(out_dir: Path) -> dict | None:
    """The progress record in `out_dir`, None when there is none; PrepareError when it can't be read."""
    path = out_dir / PROGRESS_NAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exn:
        raise PrepareError(
            f"{path} can't be read ({exn}): it records the shards an interrupted prepare wrote into "
            f"{out_dir}; nothing was changed: remove that run's files by hand or choose another --out"
        ) from exn
    ok = isinstance(record, dict) and isinstance(record.get("fingerprint"), str)
    if not ok or not isinstance(record.get("splits"), dict):
        raise PrepareError(f"{path} is not a progress record of prepare; nothing was changed")
    record_files(record, out_dir)  # checks every name
    return record


def record_files(record: dict, out_dir: Path) -> list[str]:
    """Every file a progress record says its prepare wrote (or was replacing), progress file excluded."""
    where = out_dir / PROGRESS_NAME
    names = [n for entries in record["splits"].values() for n in entry_files(entries, where)]
    for key in ("claimed", "stale"):
        names += [_check_name(n, where) for n in record.get(key, [])]
    return list(dict.fromkeys(names))


def remove_files(out_dir: Path, names: Iterable[str]) -> int:
    """Unlink `names` in `out_dir` and the temporaries written for them; returns how many existed."""
    names = set(names)
    removed = 0
    for name in sorted(names):
        try:
            (out_dir / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass
    remove_temporaries(out_dir, names)
    return removed


def remove_temporaries(out_dir: Path, names: set[str]) -> None:
    """Unlink the unfinished temporaries (`.<name>.XXXXXXXX.tmp`) of the files `names` in `out_dir`."""
    for entry in os.listdir(out_dir):
        m = _TEMP.fullmatch(entry)
        if m and m.group(1) in names:
            (out_dir / entry).unlink(missing_ok=True)


def discard(out_dir: Path, record: dict) -> int:
    """Remove the files a progress record lists, then the record itself (`--restart`); returns how many
    of them there were."""
    removed = remove_files(out_dir, record_files(record, out_dir))
    remove_temporaries(out_dir, {PROGRESS_NAME})
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)
    return removed


def _entry_problem(out_dir: Path, e: dict) -> str | None:
    """What is wrong with a recorded shard (or its index) on disk, None when both match their record."""
    try:
        problem = file_problem(out_dir / e["name"], e["bytes"], e["sha256"])
        if not problem and "index" in e:
            index = e["index"]
            problem = file_problem(out_dir / index["name"], index["bytes"], index["sha256"])
    except (KeyError, TypeError):
        return f"the record of {e.get('name')!r} is incomplete"
    return problem


class PrepareProgress:
    """Finished shards per split of an interrupted (or running) prepare into `out_dir`, with the files
    it has claimed and those it is replacing."""

    def __init__(
        self,
        out_dir: Path,
        fingerprint: str,
        splits: dict[str, list[dict]],
        *,
        settings: dict | None = None,
        claimed: Iterable[str] = (),
        stale: Iterable[str] = (),
    ):
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        self.splits = splits
        self.settings = settings
        self.claimed = list(dict.fromkeys(claimed))
        self.stale = list(dict.fromkeys(stale))

    @classmethod
    def new(
        cls,
        out_dir: Path,
        fingerprint: str,
        split_names: list[str],
        *,
        settings: dict | None = None,
        stale: Iterable[str] = (),
    ) -> PrepareProgress:
        """A fresh record, saved at once: the first file a prepare writes into `out_dir`."""
        progress = cls(out_dir, fingerprint, {s: [] for s in split_names}, settings=settings, stale=stale)
        progress.save()
        return progress

    @classmethod
    def resume(
        cls,
        out_dir: Path,
        record: dict,
        prefixes: dict[str, str],
        *,
        settings: dict | None = None,
        stale: Iterable[str] = (),
    ) -> PrepareProgress:
        """The valid recorded progress of `record` (of this run's fingerprint; `prefixes`: split -> shard
        prefix). A shard that fails its check is redone with those after it; every file the record
        listed stays claimed until it is rewritten."""
        path = out_dir / PROGRESS_NAME
        kept: dict[str, list[dict]] = {s: [] for s in prefixes}
        for split in prefixes:
            for e in record["splits"].get(split, []):
                problem = _entry_problem(out_dir, e)
                if problem:
                    log.warning("%s: %s; redoing it and what follows", path, problem)
                    break
                kept[split].append(e)
        claimed = record_files(record, out_dir)
        if "claimed" not in record:  # written before claims were recorded: the shard it was writing
            for split, prefix in prefixes.items():
                name = shard_name(prefix, len(record["splits"].get(split, [])))
                claimed += [name, index_name(name)]
        stale = [*record.get("stale", []), *stale]
        progress = cls(out_dir, record["fingerprint"], kept, settings=settings, claimed=claimed, stale=stale)
        progress.save()
        return progress

    def drop_stale(self) -> None:
        """Remove the files of the data set being replaced (its manifest first), keeping any this run has
        written since; then forget them."""
        if not self.stale:
            return
        mine = {n for entries in self.splits.values() for n in entry_files(entries, self.out_dir)}
        stale = [n for n in self.stale if n not in mine]
        if MANIFEST_NAME in stale:  # first: the directory stops being a finished data set
            (self.out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        remove_files(self.out_dir, stale)
        self.stale = []
        self.save()

    def done_docs(self, split: str) -> int:
        """Input documents (of any split) read before the last finished shard of `split` was closed."""
        entries = self.splits[split]
        return entries[-1]["end_doc"] if entries else 0

    def claim(self, names: Iterable[str]) -> None:
        """Record that this run is about to write `names` (before it creates them)."""
        new = [n for n in names if n not in self.claimed]
        if new:
            self.claimed += new
            self.stale = [n for n in self.stale if n not in new]
            self.save()

    def add(self, split: str, entries: list[dict], end_doc: int) -> None:
        """Record newly finished shards of `split`, closed after `end_doc` input documents."""
        for e in entries:
            self.splits[split].append({**e, "end_doc": end_doc})
        done = set(entry_files(entries, self.out_dir))  # listed in "splits" now
        self.claimed = [n for n in self.claimed if n not in done]
        self.save()

    def owned(self) -> set[str]:
        """Every file this record says is its prepare's (the progress file itself included)."""
        record = {"splits": self.splits, "claimed": self.claimed, "stale": self.stale}
        return {*record_files(record, self.out_dir), PROGRESS_NAME}

    def save(self) -> None:
        record: dict = {"fingerprint": self.fingerprint}
        if self.settings is not None:
            record["settings"] = self.settings
        record.update(splits=self.splits, claimed=self.claimed, stale=self.stale)
        atomic_write_text(self.out_dir / PROGRESS_NAME, json.dumps(record, indent=1) + "\n")

    def entries(self, split: str) -> list[dict]:
        """Manifest entries (without `end_doc`) of the finished shards of `split`."""
        return [{k: v for k, v in e.items() if k != "end_doc"} for e in self.splits[split]]

    def remove(self) -> None:
        (self.out_dir / PROGRESS_NAME).unlink(missing_ok=True)
