"""The embedded default data set: Python stdlib text, a fresh BPE tokenizer, train/val shards.

Why: `goat-dist train` must run out of the box, offline, on any machine. The build takes seconds, is
cached under `cache_dir/builtin-stdlib-v{vocab_size}` and appears there atomically: it is built
in a temporary sibling directory and renamed into place only when complete, so a crash never
leaves a half data set and concurrent builders are safe (the first rename wins).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from goat_dist.atomic import fsync_dir
from goat_dist.data.corpus import stdlib_documents
from goat_dist.data.shards import (
    MANIFEST_NAME,
    ShardWriter,
    dtype_name,
    read_manifest,
    sha256_file,
    split_paths,
    write_manifest,
)
from goat_dist.data.tokenizer import eos_id, train_bpe

TOKENIZER_NAME = "tokenizer.json"
SHARD_SIZE_MB = 1  # small shards so the per-epoch shard shuffle means something on an ~8 MB corpus
ENCODE_CHUNK_DOCS = 64


def builtin_dataset_dir(cache_dir: str | os.PathLike, vocab_size: int) -> Path:
    return Path(cache_dir).expanduser() / f"builtin-stdlib-v{vocab_size}"


def _is_val(texts: Sequence[str], val_fraction: float) -> list[bool]:
    """Deterministic document split by content hash (stable when other documents change).

    At least one document goes to val when val_fraction > 0 and there are two or more documents.
    """
    if val_fraction <= 0 or len(texts) < 2:
        return [False] * len(texts)
    u = [int.from_bytes(hashlib.sha256(t.encode("utf-8")).digest()[:8], "big") / 2**64 for t in texts]
    flags = [x < val_fraction for x in u]
    if not any(flags):
        flags[int(np.argmin(u))] = True
    if all(flags):
        flags[int(np.argmax(u))] = False
    return flags


def _build(out: Path, vocab_size: int, max_bytes: int, val_fraction: float, log: Callable) -> dict:
    t0 = time.perf_counter()
    docs = stdlib_documents(max_bytes)
    if not docs:
        raise RuntimeError("the Python standard library yielded no documents")
    is_val = _is_val(docs, val_fraction)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    log(f"[data] builtin corpus: {len(docs)} stdlib documents, {n_bytes / 1e6:.1f} MB")

    tok = train_bpe((d for d, v in zip(docs, is_val, strict=True) if not v), vocab_size, out / TOKENIZER_NAME)
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" in the text is plain text, not EOS
    eos = eos_id(tok)
    t_tok = time.perf_counter()

    keys = [f"doc-{i:07d}" for i in range(len(docs))]
    writers = {
        "train": ShardWriter(out, "train", SHARD_SIZE_MB, vocab_size=vocab_size),
        "val": ShardWriter(out, "val", SHARD_SIZE_MB, vocab_size=vocab_size),
    }
    try:
        for start in range(0, len(docs), ENCODE_CHUNK_DOCS):
            chunk = slice(start, start + ENCODE_CHUNK_DOCS)
            encodings = tok.encode_batch(docs[chunk], add_special_tokens=False)
            for key, val, enc in zip(keys[chunk], is_val[chunk], encodings, strict=True):
                ids = np.empty(len(enc.ids) + 1, dtype=np.uint32)
                ids[:-1] = enc.ids
                ids[-1] = eos
                writers["val" if val else "train"].write(key, ids)
        splits = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise

    manifest = {
        "vocab_size": vocab_size,
        "dtype": dtype_name(vocab_size),
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": sha256_file(out / TOKENIZER_NAME),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "eos_id": eos,
        "source": {
            "name": "python-stdlib",
            "python": platform.python_version(),
            "max_bytes": max_bytes,
            "val_fraction": val_fraction,
            "n_docs": len(docs),
            "n_bytes": n_bytes,
        },
        "splits": splits,
    }
    write_manifest(out, manifest)
    t1 = time.perf_counter()
    tokens = {name: sum(e["n_tokens"] for e in entries) for name, entries in splits.items()}
    n_shards = {name: len(entries) for name, entries in splits.items()}
    log(
        f"[data] builtin dataset: {tokens['train']:,} train / {tokens['val']:,} val tokens in "
        f"{n_shards['train']}+{n_shards['val']} shards "
        f"(corpus+tokenizer {t_tok - t0:.1f}s, total {t1 - t0:.1f}s)"
    )
    return manifest


def _check_existing(final: Path, max_bytes: int, val_fraction: float) -> None:
    manifest = read_manifest(final)
    source = manifest.get("source", {})
    want = {"max_bytes": max_bytes, "val_fraction": val_fraction}
    have = {k: source.get(k) for k in want}
    if have != want:
        raise ValueError(
            f"builtin dataset {final} was built with {have}, but {want} was asked for; "
            "delete that directory or use another cache_dir"
        )


def prepare_builtin_dataset(
    cache_dir: str | os.PathLike,
    vocab_size: int = 4096,
    max_bytes: int = 8_000_000,
    val_fraction: float = 0.01,
    log: Callable[[str], object] = print,
) -> Path:
    """Build (once) and return the directory of the built-in stdlib data set.

    The directory holds `tokenizer.json`, `train-*.tar`, `val-*.tar` and `manifest.json`
    (format `goat-dist-shards/1`). If it already exists it is returned at once, after checking it
    was built with the same `max_bytes` and `val_fraction`.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    final = builtin_dataset_dir(cache_dir, vocab_size)
    if (final / MANIFEST_NAME).is_file():
        _check_existing(final, max_bytes, val_fraction)
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _build(tmp, vocab_size, max_bytes, val_fraction, log)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST_NAME).is_file():
                raise
            # another process finished first; use its (identical) build
            shutil.rmtree(tmp, ignore_errors=True)
            _check_existing(final, max_bytes, val_fraction)
            return final
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def split_shard_paths(dataset_dir: str | os.PathLike, split: str) -> list[str]:
    """Absolute paths of the shards of `split` ("train", "val") listed in the manifest."""
    return split_paths(dataset_dir, read_manifest(dataset_dir), split)
