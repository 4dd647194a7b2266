"""`inspect` and `verify_shards`: what a data set holds, and whether every shard matches its manifest.

Why: before a long run, check that the shards are complete and readable (a truncated copy or a
bit flip shows up here, by shard name, not hours into training) and look at what was tokenized.
`inspect_dataset` reads each shard once: every sample is decoded while the bytes are hashed, and
size, sha256, document/token counts and id range are compared with the manifest.
`verify_shards` only checks sizes and checksums (`goat_dist.atomic.file_problem`). Both check each
shard's index too (`<shard>.idx.npy`): its size and sha256, and `inspect` that it equals the index a
header scan of the shard gives. The check that costs seconds whatever the data set's size (a stat per
file, nothing read) is `shard_files.shard_file_problems`: `goat-dist doctor` and the start of training.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_tools.digest import HashingFile
from data_tools.shard_format import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    ShardError,
    iter_tar_documents,
    read_manifest,
    scan_index,
)
from data_tools.tokenizer import load_tokenizer
from goat_dist.atomic import file_problem

HIST_BINS = 20  # powers of two: [1, 2), [2, 4), ...


@dataclass
class ShardReport:
    name: str
    problems: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    first_docs: list[tuple[str, np.ndarray]] = field(default_factory=list)


def verify_shards(dataset_dir: str | os.PathLike, manifest: dict | None = None) -> None:
    """Raise ShardError unless every shard named in the manifest exists with its recorded size and sha256."""
    dataset_dir = Path(dataset_dir)
    manifest = manifest if manifest is not None else read_manifest(dataset_dir)
    for entries in manifest["splits"].values():
        for e in entries:
            problem = file_problem(dataset_dir / e["name"], e["bytes"], e["sha256"])
            if problem:
                raise ShardError(f"{dataset_dir / MANIFEST_NAME}: shard {problem}")
            index = e.get("index")
            problem = index and file_problem(dataset_dir / index["name"], index["bytes"], index["sha256"])
            if problem:
                raise ShardError(f"{dataset_dir / MANIFEST_NAME}: shard index {problem}")


def check_shard(path: Path, entry: dict, vocab_size: int, keep_docs: int = 0) -> ShardReport:
    """Verify one shard against its manifest entry, reading it once; collects document lengths."""
    report = ShardReport(entry["name"])
    problem = file_problem(path, entry.get("bytes"), None, checksums=False)  # the sha256: hashed while read
    if problem:
        report.problems.append(problem)
    if not path.is_file():
        return report
    tokens = 0
    key = None
    with open(path, "rb") as f:
        stream = HashingFile(f)
        try:
            for key, ids in iter_tar_documents(stream, str(path)):
                report.lengths.append(ids.size)
                tokens += ids.size
                top = int(ids.max())
                if top >= vocab_size:
                    report.problems.append(f"sample {key!r}: token id {top} >= vocab_size {vocab_size}")
                if len(report.first_docs) < keep_docs:
                    report.first_docs.append((key, ids))
        except ShardError as exn:
            report.problems.append(str(exn))
        stream.read_rest()
    if "sha256" in entry and stream.sha256 != entry["sha256"]:
        report.problems.append(f"{path.name} does not match its sha256")
    if len(report.lengths) != entry.get("n_docs") or tokens != entry.get("n_tokens"):
        report.problems.append(
            f"read {len(report.lengths)} documents / {tokens} tokens (last sample {key!r}), manifest says "
            f"{entry.get('n_docs')} / {entry.get('n_tokens')}"
        )
    report.problems += index_problems(path, entry)
    return report


def index_problems(path: Path, entry: dict) -> list[str]:
    """What is wrong with the shard's listed index: missing, not its size or sha256, or not what a header
    scan of the shard gives. A shard listed without an index is fine (one is built when it is opened)."""
    listed = entry.get("index")
    if not listed:
        return []
    where = path.parent / listed["name"]
    problem = file_problem(where, listed.get("bytes"), listed.get("sha256"))
    if problem:
        return [f"index {problem}"]
    try:
        index = np.load(where, allow_pickle=False)
    except (OSError, ValueError) as exn:
        return [f"index {listed['name']} is not an index file: {exn}"]
    scanned, error = scan_index(path)
    if error is None and not np.array_equal(index, scanned):
        return [f"index {listed['name']} does not match the shard's members (rebuild with data prepare)"]
    return []


def histogram(lengths: list[int], width: int = 40) -> list[str]:
    """Text histogram of document lengths (tokens) in power-of-two bins."""
    if not lengths:
        return ["  (no documents)"]
    bins = np.minimum(np.log2(np.maximum(lengths, 1)).astype(int), HIST_BINS - 1)
    counts = np.bincount(bins, minlength=HIST_BINS)
    lo, hi = int(bins.min()), int(bins.max())
    peak = counts.max()
    rows = []
    for b in range(lo, hi + 1):
        bar = "#" * int(round(width * counts[b] / peak))
        rows.append(f"  {2**b:>8,}-{2 ** (b + 1) - 1:<8,} {counts[b]:>9,} {bar}".rstrip())
    return rows


def inspect_dataset(
    dataset_dir: str | Path,
    decode: int = 0,
    tokenizer: str | Path | None = None,
    echo: Callable[[str], object] = print,
) -> list[str]:
    """Print counts, a length histogram and `decode` sample documents; returns the corrupt shards' names."""
    root = Path(dataset_dir)
    manifest = read_manifest(root)
    vocab_size = manifest["vocab_size"]
    echo(f"{root}: format {manifest['format']}, vocab_size {vocab_size}, dtype {manifest['dtype']}")
    if manifest.get("command"):
        echo(f"  built by: {manifest['command']}")
    corrupt: list[str] = []
    samples: list[tuple[str, np.ndarray]] = []
    for split, entries in manifest["splits"].items():
        lengths: list[int] = []
        for e in entries:
            report = check_shard(root / e["name"], e, vocab_size, keep_docs=max(0, decode - len(samples)))
            lengths += report.lengths
            samples += report.first_docs
            if report.problems:
                corrupt.append(e["name"])
                echo(f"  CORRUPT {e['name']}: " + "; ".join(report.problems))
        n_bytes = sum(e.get("bytes", 0) for e in entries)
        n_tokens = sum(e.get("n_tokens", 0) for e in entries)
        unindexed = sum(1 for e in entries if not e.get("index"))
        echo(
            f"[{split}] {len(entries)} shards, {sum(e.get('n_docs', 0) for e in entries):,} documents, "
            f"{n_tokens:,} tokens, {n_bytes / 1e6:.1f} MB"
            + (f"; {unindexed} without an index (built when first opened)" if unindexed else "")
        )
        if lengths:
            echo(
                f"  document length (tokens): mean {np.mean(lengths):.0f}, median {np.median(lengths):.0f}, "
                f"max {max(lengths):,}"
            )
            for row in histogram(lengths):
                echo(row)
    if decode:
        _show_samples(root, manifest, samples[:decode], tokenizer, echo)
    echo(f"{len(corrupt)} corrupt shard(s)" + (": " + ", ".join(corrupt) if corrupt else ""))
    return corrupt


def _show_samples(root: Path, manifest: dict, samples, tokenizer, echo, max_chars: int = 500) -> None:
    path = Path(tokenizer) if tokenizer else root / manifest.get("tokenizer", TOKENIZER_NAME)
    tok = load_tokenizer(path) if path.is_file() else None
    if tok is None:
        echo(f"(no tokenizer at {path}: showing ids)")
    for key, ids in samples:
        text = tok.decode(ids.tolist(), skip_special_tokens=False) if tok else str(ids[:64].tolist())
        more = "..." if len(text) > max_chars else ""
        echo(f"--- {key} ({ids.size} tokens)\n{text[:max_chars]}{more}")
