"""`prepare`: raw text -> tokenized train/val shards + manifest, in parallel, restartably.

Why: the trainer reads `goat-dist-shards/1` data sets; this turns a corpus into one. Documents are
read in a fixed order, tokenized in chunks (see `encode`) and written in that order, so the
shards are byte-identical for any `workers`. Each document gets EOS appended (the token the tokenizer
file declares, or `eos_token`; recorded in the manifest as "eos_token" and "eos_id") and goes to the val
split when the hash of its text falls below `val_fraction` (duplicates share a split), or, with
`val_docs`, when it is among the N documents with the smallest hashes (an extra reading pass).
Restart: see `restart`. The manifest is written atomically, last.

`write_shards` is the pipeline itself; `prepare` runs it on input files, and the builtin data set
(`builtin`) runs it on the stdlib corpus, so both split and encode documents the same way.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.encode import Doc, encode_in_order, encoder_pool
from data_tools.inputs import COMPRESSED_EXTS, check_text_field, expand_inputs, input_kind, iter_inputs
from data_tools.out_dir import open_out, summary
from data_tools.progress import progress_bar
from data_tools.restart import PrepareError, PrepareProgress

__all__ = ["PrepareError", "prepare", "val_chooser", "write_shards"]
from data_tools.shard_format import (
    FIELDS,
    document_key,
    ids_field,
    index_name,
    new_manifest,
    read_manifest,
    write_manifest,
)
from data_tools.tokenizer import EOS_TOKEN, choose_eos, load_tokenizer
from data_tools.writer import ShardWriter
from goat_dist.atomic import sha256_file

# ---------------------------------------------------------------- the validation split


def text_hash(text: str) -> int:
    """64-bit hash of a document's text: decides its split, independently of the other documents."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def _smallest_hashes(texts: Iterable[str], n: int) -> set[int]:
    """Indices of the `n` texts with the smallest hashes (ties: lower index); none for `n` <= 0."""
    if n <= 0:
        return set()
    heap: list[tuple[int, int]] = []  # max-heap of (-hash, -index)
    for i, text in enumerate(texts):
        item = (-text_hash(text), -i)
        if len(heap) < n:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    return {-i for _, i in heap}


def val_chooser(val: dict, texts: Callable[[], Iterable[str]]) -> Callable[[int, str], bool]:
    """`is_val(index, text)` for `{"fraction": f}` (hash below f * 2**64) or `{"docs": n}` (the n
    smallest hashes; reads `texts()` once to find them)."""
    if "docs" in val:
        chosen = _smallest_hashes(texts(), val["docs"]) if val["docs"] > 0 else set()  # 0: no reading pass
        return lambda i, text: i in chosen
    threshold = int(val["fraction"] * 2**64)
    return lambda i, text: text_hash(text) < threshold


# ---------------------------------------------------------------- the pipeline


@dataclass
class Written:
    """What `write_shards` did: the manifest entries per split and the counts."""

    entries: dict[str, list[dict]]
    n_docs: int  # input documents read (all of them, also those in kept shards)
    n_bytes: int
    docs_tokenized: int
    tokens_tokenized: int


class _ShardSink:
    """Writes tokenized chunks to the train/val ShardWriters, recording finished shards for restart."""

    def __init__(self, out: Path, prefixes: dict, progress: PrepareProgress, shard_size_mb, vocab_size):
        self.progress = progress
        self.writers = {
            s: ShardWriter(
                out,
                p,
                shard_size_mb,
                vocab_size=vocab_size,
                start_index=len(progress.splits[s]),
                on_open=lambda name: progress.claim([name, index_name(name)]),
            )
            for s, p in prefixes.items()
        }
        self.docs = self.tokens = 0

    def write(self, chunk: list[Doc], lengths: np.ndarray, flat: np.ndarray) -> None:
        pos = 0
        for doc, n in zip(chunk, lengths.tolist()):
            w = self.writers[doc.split]
            before = len(w.shards)
            w.write(document_key(doc.index), flat[pos : pos + n])
            pos += n
            if len(w.shards) > before:
                self.progress.add(doc.split, w.shards[before:], end_doc=doc.index + 1)
        self.docs += len(chunk)
        self.tokens += int(lengths.sum())

    def close(self, n_docs: int) -> None:
        for s, w in self.writers.items():
            before = len(w.shards)
            w.close()
            self.progress.add(s, w.shards[before:], end_doc=n_docs)

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()


def _labelled(documents, is_val, done: dict, on_skip, stats: dict) -> Iterator[Doc]:
    """The documents still to tokenize, with their split; counts every document read in `stats`."""
    first_new = min(done.values())
    for i, (text, nbytes) in enumerate(documents):
        stats["docs"] = i + 1
        stats["bytes"] += nbytes
        if i < first_new:
            on_skip(nbytes)
            continue
        split = "val" if is_val(i, text) else "train"
        if i >= done[split]:
            yield Doc(i, text, nbytes, split)
        else:
            on_skip(nbytes)


def write_shards(
    documents: Iterable[tuple[str, int]],
    is_val: Callable[[int, str], bool],
    tok,
    out: Path,
    progress: PrepareProgress,
    *,
    vocab_size: int,
    eos: int,
    prefixes: dict[str, str],
    shard_size_mb: float,
    workers: int,
    show_progress: bool = False,
    total_bytes: int | None = None,
) -> Written:
    """Tokenize (text, input bytes) `documents` into train/val shards under `out`, each ended by token
    `eos`, after the shards `progress` already holds; every finished shard is recorded in `progress`."""
    done = {s: progress.done_docs(s) for s in prefixes}
    stats = {"docs": 0, "bytes": 0}
    sink = _ShardSink(out, prefixes, progress, shard_size_mb, vocab_size)
    # the pool forks before tqdm starts its monitor thread
    pool = encoder_pool(workers, tok.to_str(), FIELDS[ids_field(vocab_size)], eos)
    try:
        bar = progress_bar(total_bytes, show_progress)  # plain lines where stderr is no terminal
        with bar:
            for chunk, lengths, flat in encode_in_order(
                _labelled(documents, is_val, done, bar.update, stats), pool, workers
            ):
                sink.write(chunk, lengths, flat)
                bar.set_postfix(docs=sink.docs, tokens=sink.tokens, refresh=False)
                bar.update(sum(d.nbytes for d in chunk))
        pool.close()
        sink.close(stats["docs"])
    except BaseException:
        pool.terminate()
        sink.abort()
        raise
    finally:
        pool.join()
    entries = {s: progress.entries(s) for s in prefixes}
    return Written(entries, stats["docs"], stats["bytes"], sink.docs, sink.tokens)


# ---------------------------------------------------------------- the command


def _settings(files, tokenizer_sha, eos_token, text_field, shard_size_mb, val, prefix, val_prefix) -> dict:
    """Everything that determines the output bytes (not `workers`), for the restart fingerprint. The EOS
    token only counts when it is not EOS_TOKEN, the one every earlier data set used, so their
    fingerprints still match."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    eos = {} if eos_token == EOS_TOKEN else {"eos_token": eos_token}
    return {
        **eos,
        "inputs": stats,
        "tokenizer_sha256": tokenizer_sha,
        "text_field": text_field,
        "shard_size_mb": shard_size_mb,
        "val": val,
        "prefix": prefix,
        "val_prefix": val_prefix,
    }


def _plain_bytes(files: Sequence[Path]) -> int | None:
    """Total input size when it measures progress (no compressed, Parquet or Arrow input), else None."""
    if any(p.name.lower().endswith(COMPRESSED_EXTS) or input_kind(p) in ("parquet", "arrow") for p in files):
        return None
    return sum(p.stat().st_size for p in files)


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    text_field: str = "text",
    workers: int | None = None,
    shard_size_mb: float = 64.0,
    val_fraction: float = 0.01,
    val_docs: int | None = None,
    prefix: str = "train",
    val_prefix: str = "val",
    eos_token: str | None = None,
    command: str | None = None,
    show_progress: bool = True,
    echo: Callable[[str], object] = print,
    overwrite: bool = False,
    restart: bool = False,
) -> dict:
    """Tokenize `inputs` into shards under `out_dir` (see the module docstring). `eos_token` ends every
    document; None: the tokenizer file's own end-of-text token (`tokenizer.choose_eos`).

    `out_dir` must be new, empty (but for a copy of the tokenizer file) or a prepare's own output:
    the same arguments resume an interrupted run (or find a finished one: nothing to do). Other
    arguments are refused unless `overwrite` (replace a finished data set: only the files its manifest
    lists) or `restart` (drop an interrupted run: only the files its progress record lists); a file
    no prepare wrote is never replaced or removed.

    Returns {"manifest", "docs_tokenized", "tokens_tokenized", "shards_reused", "seconds"}. Raises
    InputError (bad input, named by file and line), PrepareError (`out_dir` can't be used as asked;
    nothing in it was changed) and ValueError (bad arguments, among them TextFieldError: a Parquet or Arrow
    input without that text column, found before anything is written).
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_docs is not None and val_docs < 0:
        raise ValueError(f"val_docs must be >= 0, got {val_docs}")
    if prefix == val_prefix:
        raise ValueError(f"train and val shard prefixes must differ, both are {prefix!r}")
    if workers is None:
        workers = os.cpu_count() or 1
    t0 = time.perf_counter()
    files = expand_inputs(inputs)
    check_text_field(files, text_field)
    tok = load_tokenizer(tokenizer)
    eos_token, eos = choose_eos(tok, tokenizer, eos_token)
    tokenizer_sha = sha256_file(tokenizer)
    val = {"docs": val_docs} if val_docs is not None else {"fraction": val_fraction}
    settings = _settings(files, tokenizer_sha, eos_token, text_field, shard_size_mb, val, prefix, val_prefix)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()

    out = Path(out_dir)
    prefixes = {"train": prefix, "val": val_prefix}
    progress = open_out(
        out, fingerprint, settings, prefixes, Path(tokenizer), overwrite=overwrite, restart=restart, echo=echo
    )
    if isinstance(progress, dict):
        return progress  # finished before, with these arguments
    echo(f"[data] every document ends with {eos_token!r} (id {eos})")
    reused = sum(len(v) for v in progress.splits.values())

    is_val = val_chooser(val, lambda: (text for text, _ in iter_inputs(files, text_field)))
    written = write_shards(
        iter_inputs(files, text_field),
        is_val,
        tok,
        out,
        progress,
        vocab_size=tok.get_vocab_size(),
        eos=eos,
        prefixes=prefixes,
        shard_size_mb=shard_size_mb,
        workers=workers,
        show_progress=show_progress,
        total_bytes=_plain_bytes(files),
    )
    source = {
        "inputs": [s[0] for s in settings["inputs"]],
        "text_field": text_field,
        "val": val,
        "n_docs": written.n_docs,
        "n_bytes": written.n_bytes,
    }
    recorded = {k: v for k, v in settings.items() if k != "inputs"}  # the inputs: in "source"
    manifest = new_manifest(
        tok.get_vocab_size(),
        tokenizer_sha,
        eos,
        written.entries,
        eos_token=eos_token,
        command=command,
        source=source,
        prepare={"fingerprint": fingerprint, "settings": recorded},
    )
    write_manifest(out, manifest)
    progress.remove()
    seconds = time.perf_counter() - t0
    _report(out, written, reused, seconds, val, echo)
    return summary(read_manifest(out), written.docs_tokenized, written.tokens_tokenized, reused, seconds)


def _report(out: Path, written: Written, reused: int, seconds: float, val: dict, echo) -> None:
    entries = written.entries
    tokens = {s: sum(e["n_tokens"] for e in v) for s, v in entries.items()}
    asked = val["docs"] if "docs" in val else val["fraction"]
    if not entries["val"] and asked > 0:
        echo("[data] warning: no document went to the val split; use --val-docs N for a fixed count")
    elif not entries["val"]:
        echo("[data] no val split, as asked: train on it with train.eval_interval=0")
    echo(
        f"[data] {out}: {written.n_docs:,} documents -> {tokens['train']:,} train / {tokens['val']:,} val "
        f"tokens in {len(entries['train'])}+{len(entries['val'])} shards ({seconds:.1f}s; tokenized "
        f"{written.docs_tokenized:,} documents, kept {reused} shards)"
    )
