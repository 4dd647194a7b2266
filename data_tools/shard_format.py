"""The shard format `goat-dist-shards/1`, defined once for the writer (data_tools) and the trainer.

Why one module: the writer, the inspector and the trainer's reader must agree on every byte, and
this module imports no torch, so a CPU data-preparation node can use it as is.

Format:
  * one tar member per document, `<key>.ids.u16` (vocab_size <= 65535) or `<key>.ids.u32`: the
    token ids as raw little-endian integers, EOS already appended (one webdataset sample per
    document); keys contain no '.' or '/' (webdataset splits member names at the first dot);
  * shards `<prefix>-000000.tar`, `<prefix>-000001.tar`, ... next to `manifest.json` and the
    tokenizer (`tokenizer.json`);
  * `manifest.json`: {"format", "vocab_size", "dtype", "tokenizer", "tokenizer_sha256", "eos_id",
    "splits": {split: [{"name", "n_docs", "n_tokens", "bytes", "sha256", "index"}, ...]}, ...extra keys};
  * beside each shard its index `<shard>.idx.npy` (entry "index": {"name", "bytes", "sha256"}): an int64
    `.npy` array of shape (n_docs + 1, 2). Row i < n_docs is (byte offset of document i's token ids in
    the tar, its first token within the shard); the last row is (the shard's size in bytes, its token
    count). Uncompressed tar members are contiguous bytes, so any token range is one `pread` per
    document it touches, found by binary search: nothing is decoded to seek. Shards written before the
    index existed (no "index" key) get one built by a header scan on first open (`scan_index`).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from goat_dist.atomic import atomic_write_text

FORMAT = "goat-dist-shards/1"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
# tar member suffix -> little-endian numpy dtype of the stored ids
FIELDS = {"ids.u16": np.dtype("<u2"), "ids.u32": np.dtype("<u4")}
DTYPE_NAMES = {"ids.u16": "uint16", "ids.u32": "uint32"}


INDEX_SUFFIX = ".idx.npy"


class ShardError(RuntimeError):
    """A shard that can't be read or decoded; the message names the shard and the sample key."""


# ---------------------------------------------------------------- names and encoding


def is_url(path: str) -> bool:
    """True for `scheme:...` shard locations (pipe:, http:, s3:, ...) that webdataset's gopen opens."""
    from urllib.parse import urlparse

    scheme = urlparse(path).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


def locate(path: str, name: str) -> str:
    """Location of file `name` of the data set at `path` (directory or URL prefix)."""
    if is_url(path):
        return path.replace("{}", name) if "{}" in path else path.rstrip("/") + "/" + name
    return str(Path(path).expanduser().resolve() / name)


def shard_name(prefix: str, index: int) -> str:
    """File name of shard `index` of a split whose shards start with `prefix`."""
    return f"{prefix}-{index:06d}.tar"


def document_key(index: int) -> str:
    """Sample key of input document `index` (zero-padded: keys sort like the input order)."""
    return f"doc-{index:010d}"


def check_key(key: object) -> None:
    """Raise ValueError unless `key` can name a sample (webdataset splits member names at the first '.')."""
    if not isinstance(key, str) or not key or "." in key or "/" in key or key.startswith("__"):
        raise ValueError(f"invalid document key {key!r}: need non-empty, no '.' or '/', no '__' prefix")


def ids_field(vocab_size: int) -> str:
    """Tar member suffix used for a vocabulary: 16-bit ids when they fit, else 32-bit."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit 32-bit token ids")
    return "ids.u16" if vocab_size <= 65535 else "ids.u32"


def dtype_name(vocab_size: int) -> str:
    """Manifest `dtype` for a vocabulary size ("uint16" or "uint32")."""
    return DTYPE_NAMES[ids_field(vocab_size)]


def decode_ids(sample: dict, shard: str) -> np.ndarray:
    """Token ids of one sample ({"__key__", suffix: bytes}) as a read-only uint16/uint32 array."""
    key = sample.get("__key__")
    fields = [f for f in FIELDS if f in sample]
    if len(fields) != 1:
        found = sorted(k for k in sample if not k.startswith("__"))
        raise ShardError(f"shard {shard}, sample {key!r}: expected one of {sorted(FIELDS)}, found {found}")
    data = sample[fields[0]]
    dtype = FIELDS[fields[0]]
    if len(data) == 0 or len(data) % dtype.itemsize:
        raise ShardError(f"shard {shard}, sample {key!r}: {len(data)} bytes is not a whole number of {dtype}")
    return np.frombuffer(data, dtype=dtype)


# ---------------------------------------------------------------- reading a tar stream


def _samples(stream: IO[bytes], where: list) -> Iterator[dict]:
    """Samples of a tar stream, grouping consecutive members by key as webdataset does.

    `where[0]` is kept at the name of the last member whose header was read, for error messages.
    """
    sample: dict = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            where[0] = member.name
            if not member.isreg():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key, _, suffix = base.partition(".")
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            if suffix in sample:
                raise ValueError(f"member {member.name!r} appears twice")
            sample["__key__"] = key
            sample[suffix] = tar.extractfile(member).read()
    if sample:
        yield sample


def iter_tar_documents(stream: IO[bytes], shard: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, ids) of every sample of an open tar stream; errors name `shard` and the sample.

    A shard cut exactly at a member boundary reads as a shorter valid tar: compare with the
    manifest's counts or size to catch that.
    """
    where: list = [None]
    samples = _samples(stream, where)
    while True:
        try:
            sample = next(samples)
        except StopIteration:
            return
        except Exception as exn:
            key = None if where[0] is None else where[0].rsplit("/", 1)[-1].split(".")[0]
            at = "before the first sample" if key is None else f"at or after sample {key!r}"
            detail = exn.args[0] if exn.args else repr(exn)
            raise ShardError(f"corrupt or truncated shard {shard} ({at}): {detail}") from exn
        yield sample["__key__"], decode_ids(sample, shard)


# ---------------------------------------------------------------- the shard index


def index_name(shard: str) -> str:
    """File name of a shard's index, next to it."""
    return shard + INDEX_SUFFIX


def make_index(data_offsets, doc_tokens, shard_bytes: int) -> np.ndarray:
    """The index array (see the module docstring) of documents at `data_offsets` of `doc_tokens` ids."""
    n = len(doc_tokens)
    index = np.zeros((n + 1, 2), dtype=np.int64)
    index[:n, 0] = data_offsets
    index[1:, 1] = np.cumsum(np.asarray(doc_tokens, dtype=np.int64))
    index[n, 0] = shard_bytes
    return index


def index_bytes(index: np.ndarray) -> bytes:
    """The `.npy` bytes of an index, as written next to a shard."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(index, dtype="<i8"), allow_pickle=False)
    return buf.getvalue()


def scan_index(path: str | os.PathLike) -> tuple[np.ndarray, ShardError | None]:
    """Build a shard's index by reading only its tar headers (one 512-byte block per document; the data
    is seeked over, not read).

    Returns (index, None), or for a shard that ends early or holds something other than token arrays,
    the index of the documents before the damage and a ShardError naming the shard and the sample."""
    path = os.fspath(path)
    offsets, counts = [], []
    key = None
    size = os.path.getsize(path)
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                key, _, suffix = member.name.rsplit("/", 1)[-1].partition(".")
                dtype = FIELDS.get(suffix)
                if dtype is None or member.size == 0 or member.size % dtype.itemsize:
                    raise ValueError(f"member {member.name!r} is not a token array")
                if member.offset_data + member.size > size:
                    raise ValueError("its data goes past the end of the file")
                offsets.append(member.offset_data)
                counts.append(member.size // dtype.itemsize)
    except (ValueError, tarfile.TarError, EOFError) as exn:
        at = "before the first sample" if key is None else f"at or after sample {key!r}"
        error = ShardError(f"corrupt or truncated shard {path} ({at}): {exn}")
        return make_index(offsets, counts, size), error
    return make_index(offsets, counts, size), None


def check_index(
    index: np.ndarray, where: str, shard_bytes: int | None, n_tokens: int | None, rows: bool = True
) -> np.ndarray:
    """`index` if it is a well-formed index of a shard of that size and token count, else ShardError.
    `rows=False` checks the shape and the last row only (a memory-mapped index is not read whole)."""
    if index.dtype != np.int64 or index.ndim != 2 or index.shape[1] != 2 or index.shape[0] < 1:
        raise ShardError(
            f"shard index {where}: not an int64 (n_docs + 1, 2) array: {index.dtype} {index.shape}"
        )
    size, tokens = (int(x) for x in index[-1])
    if shard_bytes is not None and size != shard_bytes:
        raise ShardError(f"shard index {where} is for a {size}-byte shard; the shard has {shard_bytes} bytes")
    if n_tokens is not None and tokens != n_tokens:
        raise ShardError(f"shard index {where} counts {tokens} tokens; the manifest lists {n_tokens}")
    if not rows:
        return index
    starts, offsets = index[:, 1], index[:-1, 0]
    if starts[0] != 0 or np.any(np.diff(starts) <= 0) or np.any(offsets < 512) or np.any(offsets >= size):
        raise ShardError(f"shard index {where}: its rows are not documents of a {size}-byte shard")
    return index


# ---------------------------------------------------------------- the manifest


def new_manifest(vocab_size: int, tokenizer_sha256: str, eos_id: int, splits: dict, **extra) -> dict:
    """A manifest of the current format; `extra` keys (provenance) go after the required ones."""
    return {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "dtype": dtype_name(vocab_size),
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_sha256,
        "eos_id": eos_id,
        **extra,
        "splits": splits,
    }


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    """Atomically write `out_dir/manifest.json`; `format` defaults to the current format."""
    manifest = {"format": FORMAT, **manifest}
    if manifest["format"] != FORMAT:
        raise ValueError(f"manifest format must be {FORMAT!r}, got {manifest['format']!r}")
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(dataset_dir: str | os.PathLike) -> dict:
    """Read and sanity-check `dataset_dir/manifest.json`.

    Raises FileNotFoundError when it is missing and ValueError (naming the file) when it is not
    JSON, has another format or lacks required fields.
    """
    path = Path(dataset_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset manifest not found: {path}") from None
    return parse_manifest(data, path)


def parse_manifest(data: bytes | str, path: object) -> dict:
    """Parse and sanity-check manifest JSON; `path` only names the source in errors."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exn:
        raise ValueError(f"dataset manifest {path} is not valid JSON: {exn}") from exn
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"dataset manifest {path} has format {got!r}, expected {FORMAT!r}")
    splits = manifest.get("splits")
    vocab_size = manifest.get("vocab_size")
    if not isinstance(vocab_size, int) or not isinstance(splits, dict):
        raise ValueError(f"dataset manifest {path} lacks an integer 'vocab_size' or a 'splits' object")
    if manifest.get("dtype") != dtype_name(vocab_size):
        got = manifest.get("dtype")
        raise ValueError(f"dataset manifest {path}: dtype {got!r} does not match vocab_size {vocab_size}")
    for split, entries in splits.items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
            raise ValueError(f"dataset manifest {path}: split {split!r} must be a list of shard entries")
    return manifest


def manifest_vocab_size(path: str) -> int | None:
    """``vocab_size`` of the manifest of the data set at ``path`` (directory or URL prefix); None when it
    can't be read here (the data stage names the problem when a run reads it)."""
    try:
        local = Path(path).expanduser()
        if (local / MANIFEST_NAME).is_file():
            return read_manifest(local)["vocab_size"]
        if not is_url(path):
            return None
        from webdataset.gopen import (
            gopen,  # a URL prefix only (webdataset, unlike this module, imports torch)
        )

        url = locate(path, MANIFEST_NAME)
        with gopen(url, "rb") as f:
            return parse_manifest(f.read(), url)["vocab_size"]
    except Exception:  # unreadable here (a URL that can't be opened, a bad manifest)
        return None


def split_paths(dataset_dir: str | os.PathLike, manifest: dict, split: str) -> list[str]:
    """Absolute shard paths of one split of a local data set."""
    if split not in manifest["splits"]:
        have = sorted(manifest["splits"])
        raise KeyError(f"split {split!r} not in the manifest of {dataset_dir} (have {have})")
    base = Path(dataset_dir).resolve()
    return [str(base / e["name"]) for e in manifest["splits"][split]]


def split_shard_paths(dataset_dir: str | os.PathLike, split: str) -> list[str]:
    """Absolute paths of the shards of `split` ("train", "val") listed in the manifest."""
    return split_paths(dataset_dir, read_manifest(dataset_dir), split)
