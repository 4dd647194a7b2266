"""`goat-dist data prepare`: raw text -> tokenized train/val shards + manifest, in parallel, restartably.

Why: the trainer reads `goat-dist-shards/1` data sets; this turns a corpus into one. The main
process reads documents in a fixed order and cuts them into chunks; worker processes tokenize
chunks with `encode_batch`; results are consumed in submission order, so the shards are
byte-identical for any `workers`. Each document gets EOS appended and goes to the val split when
the hash of its text falls below `val_fraction` (duplicates share a split), or, with `val_docs`,
when it is among the N documents with the smallest hashes (an extra reading pass).
Restart: see `restart.py`. The manifest is written atomically, last.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from goat_dist.atomic import atomic_write_bytes
from goat_dist.data.inputs import COMPRESSED_EXTS, expand_inputs, input_kind, iter_inputs
from goat_dist.data.restart import PrepareProgress
from goat_dist.data.shards import (
    FIELDS,
    MANIFEST_NAME,
    ShardWriter,
    dtype_name,
    ids_field,
    read_manifest,
    sha256_file,
    write_manifest,
)
from goat_dist.data.tokenizer import eos_id, load_tokenizer

TOKENIZER_NAME = "tokenizer.json"
CHUNK_DOCS = 256  # documents per tokenization task
CHUNK_BYTES = 1 << 18  # ... or this much text, whichever comes first (small: balances workers)


class PrepareError(RuntimeError):
    """The output directory can't be (re)used as asked."""


def _text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def _val_by_count(files: Sequence[Path], text_field: str, n: int) -> set[int]:
    """Indices of the `n` documents with the smallest text hashes (ties: lower index)."""
    heap: list[tuple[int, int]] = []  # max-heap of (-hash, -index)
    for i, (text, _) in enumerate(iter_inputs(files, text_field)):
        item = (-_text_hash(text), -i)
        if len(heap) < n:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    return {-i for _, i in heap}


# ---------------------------------------------------------------- tokenization workers

_worker: dict = {}


def _init_worker(tokenizer_json: str, dtype: str, eos: int, single_thread: bool = True) -> None:
    from tokenizers import Tokenizer

    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in the text is text, not EOS
    _worker.update(tok=tok, dtype=np.dtype(dtype), eos=eos)


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated ids) of the documents, EOS appended to each."""
    encodings = _worker["tok"].encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=_worker["dtype"])
    pos = 0
    for x, n in zip(ids, lengths.tolist()):
        flat[pos : pos + n - 1] = x
        flat[pos + n - 1] = _worker["eos"]
        pos += n
    return lengths, flat


class _Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _InProcess:
    """Pool stand-in for workers=0 (tokenizes in this process, with the tokenizer's own threads)."""

    def __init__(self, initargs):
        _init_worker(*initargs, single_thread=False)

    def apply_async(self, fn, args):
        return _Done(fn(*args))

    def terminate(self):
        pass

    def join(self):
        pass

    def close(self):
        pass


def _pool(workers: int, initargs: tuple):
    if workers == 0:
        return _InProcess(initargs)
    method = "fork" if sys.platform.startswith("linux") else None  # spawn would re-import torch
    ctx = multiprocessing.get_context(method)
    return ctx.Pool(workers, initializer=_init_worker, initargs=initargs)


# ---------------------------------------------------------------- the pipeline


def _settings(files, tokenizer_sha, text_field, shard_size_mb, val, prefix, val_prefix) -> dict:
    """Everything that determines the output bytes (not `workers`), for the restart fingerprint."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return {
        "inputs": stats,
        "tokenizer_sha256": tokenizer_sha,
        "text_field": text_field,
        "shard_size_mb": shard_size_mb,
        "val": val,
        "prefix": prefix,
        "val_prefix": val_prefix,
    }


def _labelled_docs(files, text_field, val_set, threshold, done, on_skip, stats) -> Iterator[tuple]:
    """(index, text, input bytes, split) of the documents still to tokenize; counts all in stats."""
    first_new = min(done.values())
    for i, (text, nbytes) in enumerate(iter_inputs(files, text_field)):
        stats["docs"] = i + 1
        stats["bytes"] += nbytes
        if i < first_new:
            on_skip(nbytes)
            continue
        is_val = i in val_set if val_set is not None else _text_hash(text) < threshold
        split = "val" if is_val else "train"
        if i >= done[split]:
            yield i, text, nbytes, split
        else:
            on_skip(nbytes)


def _chunks(docs: Iterator[tuple]) -> Iterator[list[tuple]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += doc[2]
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ShardSink:
    """Writes tokenized chunks to the train/val ShardWriters, recording finished shards for restart."""

    def __init__(self, out: Path, prefixes: dict, progress: PrepareProgress, shard_size_mb, vocab_size):
        self.progress = progress
        self.bar = None  # the progress bar, set while tokenizing
        self.writers = {
            s: ShardWriter(out, p, shard_size_mb, vocab_size=vocab_size, start_index=len(progress.splits[s]))
            for s, p in prefixes.items()
        }
        self.docs = self.tokens = 0

    def write(self, chunk: list[tuple], lengths: np.ndarray, flat: np.ndarray) -> None:
        pos = 0
        for (i, _, _, split), n in zip(chunk, lengths.tolist()):
            w = self.writers[split]
            before = len(w.shards)
            w.write(f"doc-{i:010d}", flat[pos : pos + n])
            pos += n
            if len(w.shards) > before:
                self.progress.add(split, w.shards[before:], end_doc=i + 1)
        self.docs += len(chunk)
        self.tokens += int(lengths.sum())
        self.bar.update(sum(d[2] for d in chunk))
        self.bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)

    def close(self, n_docs: int) -> None:
        for s, w in self.writers.items():
            before = len(w.shards)
            w.close()
            self.progress.add(s, w.shards[before:], end_doc=n_docs)

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()


def _progress_bar(files: Sequence[Path], show: bool):
    from tqdm import tqdm

    plain = all(not p.name.lower().endswith(COMPRESSED_EXTS) and input_kind(p) != "parquet" for p in files)
    total = sum(p.stat().st_size for p in files) if plain else None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not show, mininterval=0.5)
    return bar


def _tokenize_into(sink: _ShardSink, docs: Iterator[tuple], pool, workers: int) -> None:
    """Tokenize `docs` on the pool's `workers` processes; results are written in submission order."""
    pending: deque = deque()
    for chunk in _chunks(docs):
        pending.append((chunk, pool.apply_async(_encode_chunk, ([d[1] for d in chunk],))))
        if len(pending) > 2 * workers + 2:  # bounded read-ahead
            chunk, result = pending.popleft()
            sink.write(chunk, *result.get())
    while pending:
        chunk, result = pending.popleft()
        sink.write(chunk, *result.get())


def _finished(out: Path, fingerprint: str, echo) -> dict | None:
    """The summary of an already finished identical prepare, None when there is none."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(out)
    if manifest.get("prepare", {}).get("fingerprint") != fingerprint:
        raise PrepareError(f"{out} already holds a finished data set built from other inputs or arguments")
    echo(f"[data] {out} is already prepared with these arguments; nothing to do")
    return _summary(manifest, 0, 0, sum(len(v) for v in manifest["splits"].values()), 0.0)


def _summary(manifest: dict, docs: int, tokens: int, reused: int, seconds: float) -> dict:
    return {
        "manifest": manifest,
        "docs_tokenized": docs,
        "tokens_tokenized": tokens,
        "shards_reused": reused,
        "seconds": seconds,
    }


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
    command: str | None = None,
    show_progress: bool = True,
    echo: Callable[[str], object] = print,
) -> dict:
    """Tokenize `inputs` into shards under `out_dir` (see the module docstring).

    Returns {"manifest", "docs_tokenized", "tokens_tokenized", "shards_reused", "seconds"}. Raises
    InputError (bad input, named by file and line), PrepareError (`out_dir` holds a finished data
    set built differently) and ValueError (bad arguments).
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
    tok = load_tokenizer(tokenizer)
    tokenizer_sha = sha256_file(tokenizer)
    vocab_size, eos = tok.get_vocab_size(), eos_id(tok)
    val = {"docs": val_docs} if val_docs is not None else {"fraction": val_fraction}
    settings = _settings(files, tokenizer_sha, text_field, shard_size_mb, val, prefix, val_prefix)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = _finished(out, fingerprint, echo)
    if summary is not None:
        return summary
    prefixes = {"train": prefix, "val": val_prefix}
    progress = PrepareProgress.load(out, fingerprint, list(prefixes))
    reused = sum(len(v) for v in progress.splits.values())
    if reused:
        echo(f"[data] resuming: {reused} finished shard(s) kept")
    for name in prefixes.values():  # temporaries of an interrupted run
        for tmp in out.glob(f".{name}-*.tmp"):
            tmp.unlink(missing_ok=True)
    tok_bytes = Path(tokenizer).read_bytes()
    if not (out / TOKENIZER_NAME).is_file() or (out / TOKENIZER_NAME).read_bytes() != tok_bytes:
        atomic_write_bytes(out / TOKENIZER_NAME, tok_bytes)

    val_set = _val_by_count(files, text_field, val_docs) if val_docs is not None else None
    done = {s: progress.done_docs(s) for s in prefixes}
    stats = {"docs": 0, "bytes": 0}
    sink = _ShardSink(out, prefixes, progress, shard_size_mb, vocab_size)
    pool = _pool(workers, (tok.to_str(), FIELDS[ids_field(vocab_size)].str, eos))  # before tqdm's thread
    try:
        with _progress_bar(files, show_progress) as sink.bar:
            threshold = int(val_fraction * 2**64)
            docs = _labelled_docs(files, text_field, val_set, threshold, done, sink.bar.update, stats)
            _tokenize_into(sink, docs, pool, workers)
        pool.close()
        sink.close(stats["docs"])
    except BaseException:
        pool.terminate()
        sink.abort()
        raise
    finally:
        pool.join()

    entries = {s: progress.entries(s) for s in prefixes}
    manifest = {
        "vocab_size": vocab_size,
        "dtype": dtype_name(vocab_size),
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_sha,
        "eos_id": eos,
        "command": command,
        "source": {
            "inputs": [s[0] for s in settings["inputs"]],
            "text_field": text_field,
            "val": settings["val"],
            "n_docs": stats["docs"],
            "n_bytes": stats["bytes"],
        },
        "prepare": {"fingerprint": fingerprint},
        "splits": entries,
    }
    write_manifest(out, manifest)
    progress.remove()
    seconds = time.perf_counter() - t0
    tokens = {s: sum(e["n_tokens"] for e in v) for s, v in entries.items()}
    if not entries["val"] and (val_fraction > 0 if val_docs is None else val_docs > 0):
        echo("[data] warning: no document went to the val split; use --val-docs N for a fixed count")
    echo(
        f"[data] {out}: {stats['docs']:,} documents -> {tokens['train']:,} train / {tokens['val']:,} val "
        f"tokens in {len(entries['train'])}+{len(entries['val'])} shards ({seconds:.1f}s; tokenized "
        f"{sink.docs:,} documents, kept {reused} shards)"
    )
    return _summary(read_manifest(out), sink.docs, sink.tokens, reused, seconds)
