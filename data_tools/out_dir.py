"""Taking over ``prepare --out``: what a prepare may write, replace or remove there.

A directory is used when it is new, empty (but for a copy of the tokenizer file) or a prepare's own output:
its ``manifest.json`` (a finished data set, with the fingerprint of the arguments that built it) or its
progress record (an interrupted run: ``restart.py``). Other arguments are refused unless ``--overwrite``
(replace a finished data set: only the files its manifest lists) or ``--restart`` (drop an interrupted
run: only the files its record lists); an interrupted run that finished no shard (one that failed on a bad
input, say) is dropped without ``--restart``, as it holds nothing to keep. Every refusal comes before the
first change, and names what it protects; a file no prepare wrote is never replaced or removed.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from data_tools.restart import (
    PROGRESS_NAME,
    PrepareError,
    PrepareProgress,
    discard,
    entry_files,
    read_record,
    record_files,
    remove_temporaries,
)
from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME, read_manifest
from goat_dist.atomic import atomic_write_bytes


def summary(manifest: dict, docs: int, tokens: int, reused: int, seconds: float) -> dict:
    return {
        "manifest": manifest,
        "docs_tokenized": docs,
        "tokens_tokenized": tokens,
        "shards_reused": reused,
        "seconds": seconds,
    }


def _prepare_manifest(out: Path) -> dict | None:
    """The manifest in `out` when `prepare` wrote it (it records a fingerprint), else None."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = read_manifest(out)
    except (ValueError, OSError):
        return None
    info = manifest.get("prepare")
    return manifest if isinstance(info, dict) and isinstance(info.get("fingerprint"), str) else None


_FLAGS = {
    "inputs": "--input",
    "tokenizer_sha256": "--tokenizer (its content)",
    "eos_token": "--eos-token",
    "text_field": "--text-field",
    "shard_size_mb": "--shard-size",
    "val": "--val-fraction/--val-docs",
    "prefix": "--prefix",
    "val_prefix": "--val-prefix",
}


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _input_changes(old: list, new: list) -> list[str]:
    """How the inputs differ: `old` holds [path, size, mtime_ns] (or bare paths, from a manifest)."""
    was = {s: None for s in old if isinstance(s, str)} | {
        s[0]: list(s[1:]) for s in old if not isinstance(s, str)
    }
    now = {s[0]: list(s[1:]) for s in new}
    added = [p for p in now if p not in was]
    removed = [p for p in was if p not in now]
    both = [p for p in now if p in was and was[p] is not None]
    resized = [p for p in both if was[p][0] != now[p][0]]
    touched = [p for p in both if p not in resized and was[p] != now[p]]
    changes = []
    if added:
        changes.append(f"--input: {len(added)} new file(s) ({_few(added)})")
    if removed:
        changes.append(f"--input: {len(removed)} file(s) no longer given ({_few(removed)})")
    if resized:
        changes.append(f"--input: {len(resized)} file(s) changed size ({_few(resized)})")
    if touched:
        restore = "; ".join(
            f"touch -d @{was[p][1] // 10**9}.{was[p][1] % 10**9:09d} {shlex.quote(p)}" for p in touched[:3]
        )
        changes.append(
            f"--input: {len(touched)} file(s) of the same size modified since (a touch or a copy? if their "
            f"content is unchanged, restoring their modification times resumes: {restore}"
            + (" ..." if len(touched) > 3 else "")
            + ")"
        )
    if not changes and [p for p in now] != [p for p in was]:
        changes.append("--input: the same files in another order")
    return changes


def _differences(old: dict | None, new: dict) -> str:
    """What differs between the recorded settings `old` and this run's, for an error message."""
    if not isinstance(old, dict):
        return "its arguments were not recorded"
    changes = _input_changes(old["inputs"], new["inputs"]) if "inputs" in old else []
    keys = set(old) | set(new) if "prefix" in old else set()  # else: a manifest that recorded no settings
    for key in sorted(keys - {"inputs"}):
        if key == "tokenizer_sha256" and old.get(key) != new.get(key):
            changes.append("--tokenizer: a file with other content")
        elif old.get(key) != new.get(key):
            changes.append(f"{_FLAGS.get(key, key)}: {old.get(key)!r} then, {new.get(key)!r} now")
    return "; ".join(changes) if changes else "the input files' sizes or modification times differ"


def _nothing_finished(record: dict, out: Path) -> bool:
    """True for the record of a prepare that finished no shard (none recorded, none it claimed on disk:
    shards appear by rename, whole) and was replacing no data set: it failed, perhaps on a bad input, or
    was stopped early. A run of other arguments may drop it unasked: it holds nothing to keep."""
    if any(record["splits"].values()) or record.get("stale"):
        return False
    return not any((out / name).exists() for name in record_files(record, out))


def _is_output(name: str, prefixes: dict[str, str]) -> bool:
    """True for a file name this prepare may write (or replace)."""
    if name in (TOKENIZER_NAME, MANIFEST_NAME, PROGRESS_NAME):
        return True
    return any(re.fullmatch(re.escape(p) + r"-\d{6,}\.tar(\.idx\.npy)?", name) for p in prefixes.values())


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def open_out(
    out: Path,
    fingerprint: str,
    settings: dict,
    prefixes: dict[str, str],
    tokenizer: Path,
    *,
    overwrite: bool,
    restart: bool,
    echo,
) -> PrepareProgress | dict:
    """Check `out` and take it over: the summary of an identical finished prepare, or the progress to
    continue from. Every refusal comes before the first change to `out`, and only files a prepare wrote
    there (its manifest, progress record, tokenizer) are ever replaced or removed."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a directory")
    present = sorted(os.listdir(out)) if out.is_dir() else []
    tok_bytes = tokenizer.read_bytes()
    same_tokenizer = (out / TOKENIZER_NAME).is_file() and (out / TOKENIZER_NAME).read_bytes() == tok_bytes
    manifest = _prepare_manifest(out) if present else None
    record = read_record(out) if present else None

    if manifest is not None and manifest["prepare"]["fingerprint"] == fingerprint:
        if record is not None and record["fingerprint"] == fingerprint:
            (out / PROGRESS_NAME).unlink()  # left by a run stopped between its manifest and this removal
        echo(f"[data] {out} is already prepared with these arguments; nothing to do")
        return summary(manifest, 0, 0, sum(len(v) for v in manifest["splits"].values()), 0.0)

    owned: set[str] = set()
    dropped = None  # an interrupted prepare of other arguments, discarded with --restart
    if record is not None:
        owned |= {*record_files(record, out), PROGRESS_NAME, TOKENIZER_NAME}
        if record["fingerprint"] != fingerprint:
            if not restart and not _nothing_finished(record, out):  # a record of no shard: dropped unasked
                n = len(record_files(record, out))
                raise PrepareError(
                    f"{out / PROGRESS_NAME} records an interrupted prepare into {out} with other inputs or "
                    f"arguments ({_differences(record.get('settings'), settings)}); nothing was changed. "
                    f"Resume it by running prepare with its arguments, or pass --restart to delete the "
                    f"{n} file(s) that record lists and start over (no other file is touched)"
                )
            dropped, record = record, None
            if MANIFEST_NAME in record_files(dropped, out):
                manifest = None  # a data set that run was replacing: it goes with it
    stale: list[str] = []
    if manifest is not None and (record is None or MANIFEST_NAME not in record_files(record, out)):
        files = [*entry_files((e for v in manifest["splits"].values() for e in v), out / MANIFEST_NAME)]
        if not overwrite:
            recorded = dict(manifest["prepare"].get("settings") or {})
            recorded["inputs"] = (manifest.get("source") or {}).get("inputs") or []
            raise PrepareError(
                f"{out} already holds a data set built from other inputs or arguments "
                f"({_differences(recorded, settings)}); nothing was changed. Pass --overwrite to replace it "
                f"(only the {len(files) + 2} files it wrote, as its manifest.json lists them, are replaced "
                f"or removed), or choose another --out"
            )
        stale = [*files, MANIFEST_NAME]
        owned |= {*stale, TOKENIZER_NAME}
    if record is None and dropped is None and manifest is None:
        others = [n for n in present if not (n == TOKENIZER_NAME and same_tokenizer)]
        if others:
            at_risk = [n for n in others if _is_output(n, prefixes)]
            what = f"it would overwrite {_names(at_risk)}" if at_risk else f"it holds {_names(others)}"
            raise PrepareError(
                f"--out {out} is not empty and is no output of prepare (no manifest.json or {PROGRESS_NAME} "
                f"of prepare in it): {what}; nothing was changed. Choose a new or empty directory"
            )
    clash = [n for n in present if _is_output(n, prefixes) and n not in owned]
    clash = [n for n in clash if not (n == TOKENIZER_NAME and same_tokenizer)]
    if clash:
        raise PrepareError(
            f"prepare would overwrite {_names(clash)} in {out}, which no earlier prepare there wrote; "
            f"nothing was changed. Move them away or choose another --out"
        )

    out.mkdir(parents=True, exist_ok=True)
    if dropped is not None:
        n = discard(out, dropped)
        if restart:
            echo(f"[data] --restart: deleted {n} file(s) of the interrupted prepare with other arguments")
        else:
            echo(f"[data] {out}: an earlier prepare of other arguments finished no shard: starting over")
    if record is not None:
        progress = PrepareProgress.resume(out, record, prefixes, settings=settings, stale=stale)
        reused = sum(len(v) for v in progress.splits.values())
        if reused:
            echo(f"[data] resuming: {reused} finished shard(s) kept")
    else:
        progress = PrepareProgress.new(out, fingerprint, list(prefixes), settings=settings, stale=stale)
    if progress.stale:
        echo(f"[data] --overwrite: replacing the data set in {out}")
        progress.drop_stale()
    remove_temporaries(out, progress.owned() | {TOKENIZER_NAME, MANIFEST_NAME})
    if not same_tokenizer:
        atomic_write_bytes(out / TOKENIZER_NAME, tok_bytes)
    return progress
