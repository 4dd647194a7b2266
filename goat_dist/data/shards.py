"""Reading shards at run time: local files or any URL webdataset's `gopen` opens (pipe:, http:, s3 ...).

Why here and not in data_tools: `gopen` comes with webdataset, whose import pulls in torch; the
format itself (member names, id dtypes, tar decoding, the manifest) is `data_tools.shard_format`,
shared with the writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import IO

import numpy as np
from webdataset.gopen import gopen

from data_tools.shard_format import ShardError, is_url, iter_tar_documents


def open_shard(path: str) -> IO[bytes]:
    """Open a local shard or any URL webdataset's `gopen` accepts; errors name the shard."""
    try:
        return gopen(path, "rb") if is_url(path) else open(path, "rb")
    except Exception as exn:
        raise ShardError(f"cannot open shard {path}: {exn}") from exn


def _iter_shard(path: str) -> Iterator[tuple[str, np.ndarray]]:
    f = open_shard(path)
    try:
        yield from iter_tar_documents(f, path)
    except BaseException:
        try:
            f.close()
        except Exception:
            pass  # the error in hand says more than a pipe's exit status
        raise
    try:
        f.close()
    except Exception as exn:  # a `pipe:` command that failed reports it when closed
        raise ShardError(f"shard {path}: {exn}") from exn


def iter_documents(shard_paths: Iterable[str | os.PathLike]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, token ids) for every document of the shards, in order.

    Splitting shards over ranks and workers is the caller's job (webdataset's own splitters look
    at RANK/WORLD_SIZE and DataLoader workers). Ids come back as read-only little-endian
    uint16/uint32 arrays. A truncated or corrupt shard raises ShardError naming the shard and the
    sample.
    """
    if isinstance(shard_paths, (str, os.PathLike)):
        shard_paths = [shard_paths]
    for path in shard_paths:
        yield from _iter_shard(os.fspath(path))
