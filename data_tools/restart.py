"""Restart bookkeeping of `prepare`: which shards an interrupted run already finished.

Why: tokenizing a large corpus takes hours; a crash or preemption must not cost the finished
shards. After each shard is committed, `.prepare-progress.json` (written atomically) records
its manifest entry and `end_doc`, the number of input documents read when it was closed: every
document of that split with a smaller index is in a finished shard. A re-run with the same
arguments (same fingerprint) checks the recorded shards (size, sha256), keeps the valid prefix
of each split and tokenizes only what comes after it; the output is byte-identical to an
uninterrupted run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from data_tools.shard_format import index_name
from goat_dist.atomic import atomic_write_text, file_problem

PROGRESS_NAME = ".prepare-progress.json"
log = logging.getLogger("data_tools")


class PrepareProgress:
    """Finished shards per split of an interrupted (or running) prepare into `out_dir`."""

    def __init__(self, out_dir: Path, fingerprint: str, splits: dict[str, list[dict]]):
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        self.splits = splits

    @classmethod
    def load(cls, out_dir: Path, fingerprint: str, split_names: list[str]) -> PrepareProgress:
        """The valid recorded progress for this fingerprint; a stale record (other arguments) is removed."""
        path = out_dir / PROGRESS_NAME
        fresh = cls(out_dir, fingerprint, {s: [] for s in split_names})
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return fresh
        except (ValueError, OSError) as exn:
            log.warning("ignoring unreadable %s: %s", path, exn)
            return fresh
        if record.get("fingerprint") != fingerprint:
            log.warning("%s: arguments or inputs changed since the interrupted run; starting over", out_dir)
            for entries in record.get("splits", {}).values():
                for e in entries:
                    (out_dir / e["name"]).unlink(missing_ok=True)
                    (out_dir / index_name(e["name"])).unlink(missing_ok=True)
            path.unlink()
            return fresh
        for split in split_names:
            for e in record.get("splits", {}).get(split, []):
                problem = file_problem(out_dir / e["name"], e["bytes"], e["sha256"])
                if not problem and "index" in e:
                    index = e["index"]
                    problem = file_problem(out_dir / index["name"], index["bytes"], index["sha256"])
                if problem:
                    log.warning("%s: %s; redoing it and what follows", out_dir / PROGRESS_NAME, problem)
                    break
                fresh.splits[split].append(e)
        return fresh

    def done_docs(self, split: str) -> int:
        """Input documents (of any split) read before the last finished shard of `split` was closed."""
        entries = self.splits[split]
        return entries[-1]["end_doc"] if entries else 0

    def add(self, split: str, entries: list[dict], end_doc: int) -> None:
        """Record newly finished shards of `split`, closed after `end_doc` input documents."""
        for e in entries:
            self.splits[split].append({**e, "end_doc": end_doc})
        self.save()

    def save(self) -> None:
        record = {"fingerprint": self.fingerprint, "splits": self.splits}
        atomic_write_text(self.out_dir / PROGRESS_NAME, json.dumps(record, indent=1) + "\n")

    def entries(self, split: str) -> list[dict]:
        """Manifest entries (without `end_doc`) of the finished shards of `split`."""
        return [{k: v for k, v in e.items() if k != "end_doc"} for e in self.splits[split]]

    def remove(self) -> None:
        (self.out_dir / PROGRESS_NAME).unlink(missing_ok=True)
