"""Raw text inputs of `prepare` and `tokenizer train`: files, directories, globs -> documents.

Why: corpora arrive as plain text, JSONL, Parquet or Hugging Face `datasets` on disk, often compressed.
One reader turns them all into a deterministic sequence of documents and reports bad input by file and
line, so a bad byte deep in a 50 GB dump is found and fixed, not silently dropped.

Formats, by file name (after stripping `.gz` / `.zst`):
  * `.jsonl` / `.ndjson`: one JSON object per line; the document is its `text_field` string;
  * `.parquet`: the `text_field` column (needs pyarrow), read a row batch at a time;
  * `.arrow`: the `text_field` column of an Arrow IPC file (a datasets cache's `<name>-<split>*.arrow`),
    memory-mapped, a record batch at a time (needs pyarrow, see `hf_datasets`);
  * anything else: plain UTF-8 text, the whole file is one document.
Directories are searched recursively for `.txt .text .md .jsonl .ndjson .parquet` files (optionally
compressed) and for `datasets` save_to_disk directories (their Arrow files, in their order; a
DatasetDict's train split); hidden files are skipped. Loose `.arrow` files are read only when named (or
globbed): a datasets cache directory also holds the `cache-*.arrow` results of `.map()`, which would
repeat its rows. Each argument's matches are sorted; order is as given.
Empty documents (and JSON/Parquet/Arrow nulls) are skipped; a missing or non-string field is an error;
a Parquet or Arrow schema without a text column `text_field` is a `TextFieldError` (a wrong argument).
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

from data_tools.hf_datasets import open_arrow, record_batches, saved_datasets_under

TEXT_EXTS = (".txt", ".text", ".md")
JSONL_EXTS = (".jsonl", ".ndjson")
PARQUET_EXTS = (".parquet",)
ARROW_EXTS = (".arrow",)
COMPRESSED_EXTS = (".gz", ".zst")
BATCH_ROWS = 1024  # Parquet/Arrow rows in memory at a time (pyarrow's default, 65,536 long documents: GBs)


class InputError(ValueError):
    """Bad input data; the message starts with `file:line:`."""


class TextFieldError(ValueError):
    """`--text-field` names no text column of a Parquet or Arrow input: the argument is at fault, not the
    data (so it is not an InputError)."""


def _is_text(kind) -> bool:
    """A string column, or an all-null one (pyarrow's type of an empty or all-None list of texts)."""
    import pyarrow as pa

    if pa.types.is_null(kind):
        return True
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind)


def check_column(path: Path, field: str, schema) -> int:
    """Index of `field` in a Parquet/Arrow `schema`; a TextFieldError naming the text columns there
    when it is missing or not text."""
    names = schema.names
    texts = [f.name for f in schema if _is_text(f.type)]
    fix = f"pass --text-field with one of its text columns ({', '.join(texts) or 'none'})"
    if field not in names:
        raise TextFieldError(f"--text-field {field!r}: {path} has no such column (columns: {names}); {fix}")
    index = names.index(field)
    if not _is_text(schema.field(index).type):
        raise TextFieldError(
            f"--text-field {field!r}: in {path} it is a {schema.field(index).type} column, not text; {fix}"
        )
    return index


def _base_name(path: Path) -> str:
    name = path.name.lower()
    for ext in COMPRESSED_EXTS:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def input_kind(path: str | os.PathLike) -> str:
    """ "jsonl", "parquet", "arrow" or "text"."""
    name = _base_name(Path(path))
    if name.endswith(JSONL_EXTS):
        return "jsonl"
    if name.endswith(PARQUET_EXTS):
        return "parquet"
    if name.endswith(ARROW_EXTS):
        return "arrow"
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
            # a save_to_disk data set sorts as one unit, by its first file, and keeps its own order
            units = [[p] for p in path.rglob("*") if p.is_file() and _known(p)]
            units += [files for files in saved_datasets_under(path) if files]
            found = [p for unit in sorted(units) for p in unit]
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
    if path.name.lower().endswith(PARQUET_EXTS):
        source = str(path)  # pyarrow's own reads: no Python bytes of the column chunks
    else:
        with open_input(path) as f:
            source = io.BytesIO(f.read())
    try:
        pf = pq.ParquetFile(source)
    except Exception as exn:
        raise InputError(f"{path}: not a readable Parquet file: {exn}") from None
    with pf:
        check_column(path, field, pf.schema_arrow)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                if value:
                    yield value, len(value.encode("utf-8"))


def _arrow_reader(path: Path):
    try:
        import pyarrow as pa
    except ImportError:
        raise InputError(f"{path}: reading Arrow needs the 'pyarrow' package (pip install pyarrow)") from None
    if path.name.lower().endswith(COMPRESSED_EXTS):
        raise InputError(f"{path}: Arrow files are read memory-mapped; decompress it first")
    try:
        return open_arrow(path)
    except pa.ArrowInvalid as exn:
        raise InputError(f"{path}: not a readable Arrow IPC file: {exn}") from None


def _iter_arrow(path: Path, field: str) -> Iterator[tuple[str, int]]:
    reader = _arrow_reader(path)
    index = check_column(path, field, reader.schema)
    for batch in record_batches(reader):
        column = batch.column(index)
        for start in range(0, len(column), BATCH_ROWS):  # zero-copy slices: a writer's batch may be huge
            for value in column.slice(start, BATCH_ROWS).to_pylist():
                if value:
                    yield value, len(value.encode("utf-8"))


def check_text_field(files: Sequence[Path], field: str) -> None:
    """Every uncompressed Parquet and Arrow input has a text column `field` (their schemas only), so a
    wrong `--text-field` stops the command before it writes anything (see `check_column`)."""
    for path in files:
        kind = input_kind(path)
        if path.name.lower().endswith(COMPRESSED_EXTS) or kind not in ("parquet", "arrow"):
            continue
        if kind == "arrow":
            check_column(path, field, _arrow_reader(path).schema)
            continue
        try:
            import pyarrow.parquet as pq

            schema = pq.read_schema(path)
        except ImportError:
            continue  # said when the file is read
        except Exception as exn:
            raise InputError(f"{path}: not a readable Parquet file: {exn}") from None
        check_column(path, field, schema)


def iter_file(path: str | os.PathLike, text_field: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes it took) for every non-empty document of one file."""
    path = Path(path)
    kind = input_kind(path)
    if kind == "jsonl":
        return _iter_jsonl(path, text_field)
    if kind == "parquet":
        return _iter_parquet(path, text_field)
    if kind == "arrow":
        return _iter_arrow(path, text_field)
    return (d for d in _iter_text(path) if d[0])


def iter_inputs(files: Sequence[Path], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """All documents of `files` in order (see `iter_file`)."""
    for path in files:
        yield from iter_file(path, text_field)
