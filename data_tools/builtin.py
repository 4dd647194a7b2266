"""The embedded default data set: Python stdlib text, a fresh BPE tokenizer, train/val shards.

Why: `goat-dist train` must run out of the box, offline, on any machine. The documents go through
the same pipeline as `prepare` (`prepare.write_shards`: same val split hash, same encoding and
sample keys), in this process. The val documents are chosen first, by count (at least one, so
validation has data even on a tiny corpus), and the tokenizer is trained on the rest. The build
takes seconds, is cached under `cache_dir/builtin-stdlib-v{vocab_size}[-{max_bytes}b]` and appears there
atomically: it is built in a temporary sibling directory and renamed into place only when
complete, so a crash never leaves a half data set and concurrent builders are safe (the first
rename wins).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from data_tools.corpus import stdlib_documents
from data_tools.prepare import val_chooser, write_shards
from data_tools.restart import PrepareProgress
from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME, new_manifest, read_manifest, write_manifest
from data_tools.tokenizer import EOS_TOKEN, eos_id, train_bpe
from goat_dist.atomic import fsync_dir, sha256_file

SHARD_SIZE_MB = 1  # small shards so the per-epoch shard shuffle means something on an ~8 MB corpus


DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_VAL_FRACTION = 0.01


def builtin_dataset_dir(
    cache_dir: str | os.PathLike,
    vocab_size: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Path:
    """Where the builtin data set of these settings lives (or will live) under `cache_dir`: the default
    size is `builtin-stdlib-v{vocab_size}`, any other size or split gets its own directory, so a smaller
    build (tests use 1 MB) never stands in the way of the default one."""
    name = f"builtin-stdlib-v{vocab_size}"
    if max_bytes != DEFAULT_MAX_BYTES:
        name += f"-{max_bytes}b"
    if val_fraction != DEFAULT_VAL_FRACTION:
        name += f"-val{val_fraction:g}"
    return Path(cache_dir).expanduser() / name


def val_count(n_docs: int, val_fraction: float) -> int:
    """Val documents for `val_fraction` of `n_docs`: at least one and at most all but one (when
    val_fraction > 0 and there are two or more documents)."""
    if val_fraction <= 0 or n_docs < 2:
        return 0
    return min(max(1, round(val_fraction * n_docs)), n_docs - 1)


def _build(out: Path, vocab_size: int, max_bytes: int, val_fraction: float, log: Callable) -> dict:
    t0 = time.perf_counter()
    docs = stdlib_documents(max_bytes)
    if not docs:
        raise RuntimeError("the Python standard library yielded no documents")
    sizes = [len(d.encode("utf-8")) for d in docs]
    log(f"[data] builtin corpus: {len(docs)} stdlib documents, {sum(sizes) / 1e6:.1f} MB")
    is_val = val_chooser({"docs": val_count(len(docs), val_fraction)}, lambda: docs)
    tok = train_bpe((d for i, d in enumerate(docs) if not is_val(i, d)), vocab_size, out / TOKENIZER_NAME)
    t_tok = time.perf_counter()
    eos = eos_id(tok, EOS_TOKEN)  # the token train_bpe builds in

    progress = PrepareProgress.new(out, "builtin", ["train", "val"])  # `out`: a fresh temporary directory
    written = write_shards(
        zip(docs, sizes),
        is_val,
        tok,
        out,
        progress,
        vocab_size=vocab_size,
        eos=eos,
        prefixes={"train": "train", "val": "val"},
        shard_size_mb=SHARD_SIZE_MB,
        workers=0,  # in this process: it may be a training process, which should not fork
    )
    progress.remove()
    source = {
        "name": "python-stdlib",
        "python": platform.python_version(),
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "n_docs": written.n_docs,
        "n_bytes": written.n_bytes,
    }
    tokenizer_sha = sha256_file(out / TOKENIZER_NAME)
    manifest = new_manifest(
        vocab_size,
        tokenizer_sha,
        eos,
        written.entries,
        eos_token=EOS_TOKEN,
        tokenizer_vocab_size=tok.get_vocab_size(),
        source=source,
    )
    write_manifest(out, manifest)
    t1 = time.perf_counter()
    tokens = {name: sum(e["n_tokens"] for e in entries) for name, entries in written.entries.items()}
    n_shards = {name: len(entries) for name, entries in written.entries.items()}
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
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    log: Callable[[str], object] = print,
) -> Path:
    """Build (once) and return the directory of the built-in stdlib data set.

    The directory holds `tokenizer.json`, `train-*.tar`, `val-*.tar` and `manifest.json`
    (format `goat-dist-shards/1`). If it already exists it is returned at once, after checking it
    was built with the same `max_bytes` and `val_fraction`.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    final = builtin_dataset_dir(cache_dir, vocab_size, max_bytes, val_fraction)
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
