"""The data check: the configured source(s) reachable (manifest readable, shard files present, each the
size its manifest records: a stat per shard, no reads), or the builtin corpus ready or buildable."""

from __future__ import annotations

import os
from pathlib import Path

from .report import Report


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


SHARDS_NAMED = 3  # shard problems spelled out per data set; the rest are counted


def shard_size_problems(dataset_dir: Path, manifest: dict) -> list[str]:
    """Shards of a local data set (every split) that are missing or whose size on disk differs from the
    manifest's ``bytes``: one stat per shard, nothing read (``goat-dist data inspect`` reads and hashes)."""
    problems = []
    for entries in manifest["splits"].values():
        for e in entries:
            path = dataset_dir / e["name"]
            expected = e.get("bytes")
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                size = f" (the manifest lists {expected} bytes)" if expected is not None else ""
                problems.append(f"shard {e['name']} is missing{size}")
                continue
            except OSError as err:
                problems.append(f"shard {e['name']} cannot be read: {err}")
                continue
            if expected is not None and actual != expected:
                problems.append(
                    f"shard {e['name']} is {actual} bytes on disk, the manifest says {expected} bytes "
                    "(truncated or changed copy?)"
                )
    return problems


def _shard_summary(dataset_dir: Path, problems: list[str]) -> str:
    named = "; ".join(problems[:SHARDS_NAMED])
    more = len(problems) - SHARDS_NAMED
    return f"{dataset_dir}: {named}" + (f"; and {more} more shard(s)" if more > 0 else "")


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
