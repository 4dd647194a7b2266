"""The data check: the configured source(s) reachable (manifest readable, shard and index files present,
each the size its manifest records: a stat per file, no reads), or the builtin corpus ready or buildable."""

from __future__ import annotations

import os
from pathlib import Path

from data_tools.shard_files import SHARDS_NAMED, shard_file_problems, summarize_problems

from .report import Report

__all__ = ["SHARDS_NAMED", "check_data", "shard_size_problems"]


def _reachable_url(url: str, timeout: float = 20.0) -> str | None:
    """None if ``url/manifest.json`` can be read; else why not. Only http(s) and file URLs are probed."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/manifest.json"
    if not target.startswith(("http://", "https://", "file://")):
        return ""  # not probed
    try:
        with urllib.request.urlopen(target, timeout=timeout) as r:
            r.read(1)
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{target}: {e}"


def shard_size_problems(dataset_dir: Path, manifest: dict) -> list[str]:
    """Shards of a local data set (every split) and their listed indexes that are missing or not the size
    the manifest records: one stat per file, nothing read (the check training starts with, too)."""
    return shard_file_problems(dataset_dir, manifest)


def _shard_summary(dataset_dir: Path, problems: list[str]) -> str:
    return f"{dataset_dir}: {summarize_problems(problems)}"


def check_data(report: Report, cfg) -> None:
    from ..data import builtin_dataset_dir, read_manifest, split_shard_paths
    from ..data.shards import is_url

    d = cfg.data
    if d.sources:
        paths = [str(s.get("path")) for s in d.sources]
    elif d.source == "builtin":
        target = builtin_dataset_dir(d.cache_dir, cfg.model.vocab_size, d.builtin_max_bytes)
        if (target / "manifest.json").is_file():
            try:
                bad = shard_size_problems(target, read_manifest(target))
            except (OSError, ValueError) as e:
                bad = [str(e)]
            if bad:
                report.fail("data", f"builtin corpus: {_shard_summary(target, bad)}")
            else:
                report.ok("data", f"builtin corpus ready in {target}")
            return
        parent = target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            probe = parent / f".doctor-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            report.fail("data", f"builtin corpus not built and its cache dir {parent} is not writable: {e}")
            return
        report.ok("data", f"builtin corpus not built yet: rank 0 builds it in {target} at the start")
        return
    else:
        paths = [d.source]
    problems, checked, skipped = [], 0, []
    for raw in paths:
        if is_url(raw):
            why = _reachable_url(raw)
            if why:
                problems.append(why)
            elif why == "":
                skipped.append(raw)
            else:
                checked += 1
            continue
        path = Path(raw).expanduser()
        try:
            manifest = read_manifest(path)
            shards = split_shard_paths(path, "train")
            bad = shard_size_problems(path, manifest)
            missing = [s for s in shards if not os.access(s, os.R_OK)]
            if bad:
                problems.append(_shard_summary(path, bad))
            elif missing:
                problems.append(
                    f"{path}: {len(missing)} of {len(shards)} train shards unreadable, e.g. {missing[0]}"
                )
            elif not shards:
                problems.append(f"{path}: the manifest lists no train shards")
            elif manifest.get("vocab_size", 0) > cfg.model.vocab_size:
                problems.append(
                    f"{path}: tokenized with vocab_size {manifest['vocab_size']} > model.vocab_size "
                    f"{cfg.model.vocab_size}"
                )
            else:
                checked += 1
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
    if problems:
        report.fail("data", "; ".join(problems))
        return
    note = f" (not probed: {', '.join(skipped)})" if skipped else ""
    report.ok("data", f"{checked} source(s) reachable{note}")
