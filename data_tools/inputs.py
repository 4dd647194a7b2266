"""Raw text inputs of `prepare` and `tokenizer train`: files, directories, globs -> documents.

Why: corpora arrive as plain text, JSONL or Parquet, often compressed. One reader turns them all
into a deterministic sequence of documents and reports bad input by file and line, so a bad byte
deep in a 50 GB dump is found and fixed, not silently dropped.

Formats, by file name (after stripping `.gz` / `.zst`):
  * `.jsonl` / `.ndjson`: one JSON object per line; the document is its `text_field` string;
  * `.parquet`: the `text_field` column (needs pyarrow);
  * anything else: plain UTF-8 text, the whole file is one document.
Directories are searched recursively for `.txt .text .md .jsonl .ndjson .parquet` files (optionally
compressed); hidden files are skipped. Each argument's matches are sorted; order is as given.
Empty documents (and JSON/Parquet nulls) are skipped; a missing or non-string field is an error.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

TEXT_EXTS = (".txt", ".text", ".md")
JSONL_EXTS = (".jsonl", ".ndjson")
PARQUET_EXTS = (".parquet",)
COMPRESSED_EXTS = (".gz", ".zst")


class InputError(ValueError):
    """Bad input data; the message starts with `file:line:`."""


def _base_name(path: Path) -> str:
    name = path.name.lower()
    for ext in COMPRESSED_EXTS:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def input_kind(path: str | os.PathLike) -> str:
    """ "jsonl", "parquet" or "text"."""
    name = _base_name(Path(path))
    if name.endswith(JSONL_EXTS):
        return "jsonl"
    if name.endswith(PARQUET_EXTS):
        return "parquet"
    return "text"


def _known(path: Path) -> bool:
    return not path.name.startswith(".") and _base_name(path).endswith(TEXT_EXTS + JSONL_EXTS + PARQUET_EXTS)


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by `patterns` (files, directories, globs), deduplicated, in a deterministic order."""
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        path = Path(pattern).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _known(p))
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
            found = [p for p in found if p.is_file()]
            if not found:
                raise FileNotFoundError(f"input {pattern!r} matches no file")
        for p in found:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    if not out:
        raise FileNotFoundError(f"no input files in {list(map(str, patterns))}")
    return out


def open_input(path: str | os.PathLike) -> IO[bytes]:
    """Binary stream of a file, decompressing `.gz` and `.zst`."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise InputError(
                f"{path}: reading .zst needs the 'zstandard' package (pip install zstandard)"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _utf8(data: bytes, path: Path, line: int | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exn:
        if line is None:
            line = data.count(b"\n", 0, exn.start) + 1
        raise InputError(f"{path}:{line}: not valid UTF-8 ({exn.reason} at byte {exn.start})") from None


def _field(value: object, field: str, path: Path, where: str) -> str | None:
    if not isinstance(value, dict):
        raise InputError(f"{path}:{where}: expected a JSON object, got {type(value).__name__}")
    if field not in value:
        raise InputError(f"{path}:{where}: no {field!r} field (keys: {sorted(value)[:10]})")
    text = value[field]
    if text is not None and not isinstance(text, str):
        raise InputError(f"{path}:{where}: field {field!r} is {type(text).__name__}, not a string")
    return text


def _iter_text(path: Path) -> Iterator[tuple[str, int]]:
    with open_input(path) as f:
        data = f.read()
    yield _utf8(data, path, None), len(data)


def _iter_jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
    with open_input(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line = _utf8(raw, path, lineno)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exn:
                raise InputError(f"{path}:{lineno}: invalid JSON: {exn.msg} (column {exn.colno})") from None
            text = _field(obj, field, path, str(lineno))
            if text:
                yield text, len(raw)


def _iter_parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(
            f"{path}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)"
        ) from None
    with open_input(path) as f:
        source = f if path.name.lower().endswith(PARQUET_EXTS) else io.BytesIO(f.read())
        try:
            pf = pq.ParquetFile(source)
        except Exception as exn:
            raise InputError(f"{path}: not a readable Parquet file: {exn}") from None
        if field not in pf.schema_arrow.names:
            raise InputError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names})")
        row = 0
        for batch in pf.iter_batches(columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if value is not None and not isinstance(value, str):
                    raise InputError(
                        f"{path}:row {row}: column {field!r} is {type(value).__name__}, not text"
                    )
                if value:
                    yield value, len(value.encode("utf-8"))


def iter_file(path: str | os.PathLike, text_field: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes it took) for every non-empty document of one file."""
    path = Path(path)
    kind = input_kind(path)
    if kind == "jsonl":
        return _iter_jsonl(path, text_field)
    if kind == "parquet":
        return _iter_parquet(path, text_field)
    return (d for d in _iter_text(path) if d[0])


def iter_inputs(files: Sequence[Path], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """All documents of `files` in order (see `iter_file`)."""
    for path in files:
        yield from iter_file(path, text_field)
