"""Tokenization for `prepare`: chunks of documents encoded with `encode_batch`, in worker processes.

Why: tokenizing is the expensive step of preparing a corpus. Workers each tokenize whole chunks
single-threaded (the pool is the parallelism); results are consumed in submission order, so the
output does not depend on the number of workers. `workers=0` encodes in this process with the
tokenizer's own threads (what the builtin data set uses inside a training process, where forking
is best avoided).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

CHUNK_DOCS = 256  # documents per tokenization task
CHUNK_BYTES = 1 << 18  # ... or this much text, whichever comes first (small: balances workers)


class Doc(NamedTuple):
    """One input document on its way to a shard."""

    index: int  # position in the input: the sample key
    text: str
    nbytes: int  # input bytes it took (progress, chunk size)
    split: str  # "train" or "val"


_worker: dict = {}


def _init_worker(tokenizer_json: str, dtype: str, eos: int, single_thread: bool = True) -> None:
    from tokenizers import Tokenizer

    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True  # a literal "<|endoftext|>" or "</s>" in the text is text, not EOS
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


def encoder_pool(workers: int, tokenizer_json: str, dtype: np.dtype, eos: int):
    """A pool of `workers` tokenizer processes (fork on Linux: no re-import), or in-process for 0."""
    initargs = (tokenizer_json, np.dtype(dtype).str, eos)
    if workers == 0:
        return _InProcess(initargs)
    method = "fork" if sys.platform.startswith("linux") else None
    return multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=initargs)


def chunks(docs: Iterable[Doc]) -> Iterator[list[Doc]]:
    """Consecutive chunks of at most CHUNK_DOCS documents or about CHUNK_BYTES of input."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += doc.nbytes
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_in_order(docs: Iterable[Doc], pool, workers: int) -> Iterator[tuple]:
    """(chunk, lengths, flat ids) for chunks of `docs`, in input order, with bounded read-ahead."""
    pending: deque = deque()
    for chunk in chunks(docs):
        pending.append((chunk, pool.apply_async(_encode_chunk, ([d.text for d in chunk],))))
        if len(pending) > 2 * workers + 2:
            chunk, result = pending.popleft()
            yield chunk, *result.get()
    while pending:
        chunk, result = pending.popleft()
        yield chunk, *result.get()
