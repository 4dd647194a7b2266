"""Hugging Face `datasets` on disk as `prepare` input, read with pyarrow alone (no `datasets` import).

Why: corpora often arrive as what `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote, or as the
Arrow files of a datasets cache (`<name>-<split>-NNNNN-of-NNNNN.arrow`). Both are Arrow IPC files;
reading them memory-mapped, one record batch at a time, streams a data set of any size through a CPU
node that has neither `datasets` nor the memory to load it.

  * a `save_to_disk` directory of a `Dataset` holds `state.json`, whose `_data_files` lists its Arrow
    files in order;
  * one of a `DatasetDict` holds `dataset_dict.json` and a directory per split: its `train` split is
    read (the other splits are held out by the data set's makers; `prepare` draws its own val split),
    another one is read by naming its directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

DATASET_STATE = "state.json"  # Dataset.save_to_disk
DATASET_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk
TRAIN_SPLIT = "train"


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    return (path / DATASET_STATE).is_file() or (path / DATASET_DICT).is_file()


def saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a save_to_disk directory, in row order (a DatasetDict: its train split's)."""
    if (path / DATASET_DICT).is_file():
        splits = json.loads((path / DATASET_DICT).read_text())["splits"]
        if TRAIN_SPLIT not in splits:
            raise ValueError(
                f"--input {path}: a DatasetDict without a {TRAIN_SPLIT!r} split (splits: "
                f"{', '.join(splits)}); name the split to read, e.g. --input {path / splits[0]}"
            )
        path = path / TRAIN_SPLIT
    state = json.loads((path / DATASET_STATE).read_text())
    files = [path / f["filename"] for f in state["_data_files"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"--input {path}: {DATASET_STATE} lists missing file(s) {', '.join(missing)}")
    return files


def saved_datasets_under(root: Path) -> list[list[Path]]:
    """The Arrow files of every save_to_disk directory at or under `root`, one list per data set (see
    `saved_dataset_files`)."""
    found: list[list[Path]] = []
    for top, dirs, _ in os.walk(root):
        here = Path(top)
        if is_saved_dataset(here):
            found.append(saved_dataset_files(here))
            dirs[:] = []  # its split directories are read through it
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
    return found


def open_arrow(path: Path):
    """A record-batch reader over a memory-mapped Arrow IPC stream (what datasets writes) or file;
    pyarrow's ArrowInvalid when it is neither."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
    return pa.ipc.open_file(source)


def record_batches(reader) -> Iterator:
    """The record batches of `open_arrow`'s reader, one at a time (memory-mapped: nothing is copied)."""
    if hasattr(reader, "num_record_batches"):  # the IPC file format
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)
