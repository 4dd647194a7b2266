"""Synthetic passkey retrieval: a generated training source (``data.synthetic: passkey``) and the task of
``goat-dist eval passkey``.

Why: the GOAT paper's passkey experiment trains at a short context and tests far longer ones; a task
whose answer needs one token from anywhere in the context measures whether attention still *finds*
things beyond the training length, which perplexity averages away. (Mohtashami & Jaggi's passkey
task, token-level.)

A sequence of ``length + 1`` tokens over a small fixed alphabet (token ids, independent of any
tokenizer, so any model with ``vocab_size >= VOCAB`` can learn it):

    filler ... KEY d1 d2 d3 d4 d5 KEY_END filler ... QUERY d1 d2 d3 d4 d5

The filler is one fixed 24-token "sentence" repeated from a random phase; the key block sits at
``depth`` (0 = start, 1 = end) of the filler; the 5 random digits are the passkey. A model reads the
first ``length`` tokens and must predict the answer digits after QUERY. As training data, the labels of
the key's own digits are ignored (-100: they are random, nothing can predict them); the answer digits
are where retrieval is learned.

Sample ``n`` of a split is a pure function of (seed, split, n): the stream is infinite, never repeats,
and resumes exactly at any sample, like the shard loader (``loader.PackedBatches``), whose rank and worker
layout it follows: global sample ``n`` belongs to data-parallel rank ``n % dp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_tools.shard_format import FORMAT, MANIFEST_NAME, dtype_name

from ..atomic import atomic_write_text
from .loader import IGNORE_INDEX

EOS = 0
DIGIT0 = 1  # digits 0-9 are ids 1-10
KEY, KEY_END, QUERY = 11, 12, 13
FILLER_START, FILLER_LEN = 16, 24
VOCAB = FILLER_START + FILLER_LEN
DIGITS = 5
KEY_BLOCK = DIGITS + 2  # KEY, digits, KEY_END
ANSWER_BLOCK = DIGITS + 1  # QUERY, digits
MIN_LENGTH = KEY_BLOCK + ANSWER_BLOCK
TASKS = ("passkey",)
_SPLIT_TAG = {"train": 0x747261, "val": 0x76616C, "eval": 0x65766C}


def passkey_sequence(length: int, depth: float, rng: np.random.Generator) -> np.ndarray:
    """``length + 1`` tokens: the model input is the first ``length``, the answer the last ``DIGITS``."""
    if length < MIN_LENGTH:
        raise ValueError(f"a passkey sequence needs length >= {MIN_LENGTH}, got {length}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    digits = DIGIT0 + rng.integers(0, 10, size=DIGITS)
    filler_total = length + 1 - MIN_LENGTH
    phase = int(rng.integers(FILLER_LEN))
    filler = FILLER_START + (phase + np.arange(filler_total)) % FILLER_LEN
    before = int(round(depth * filler_total))
    return np.concatenate(
        [filler[:before], [KEY], digits, [KEY_END], filler[before:], [QUERY], digits]
    ).astype(np.int64)


def answer_positions(length: int) -> slice:
    """Input positions whose next-token predictions are the answer digits."""
    return slice(length - DIGITS, length)


def key_position(sequence: np.ndarray) -> int:
    return int(np.flatnonzero(sequence == KEY)[0])


def training_example(sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of a sequence; the labels of the key's random digits are ignored."""
    tokens, labels = sequence[:-1].copy(), sequence[1:].copy()
    k = key_position(sequence)
    labels[k : k + DIGITS] = IGNORE_INDEX  # predicting d1..d5 right after KEY: pure chance
    return tokens, labels


def sample_rng(seed: int, split: str, n: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_TAG[split], n])


class PasskeyBatches(IterableDataset):
    """Infinite stream of this rank's passkey micro-batches, the same dicts as ``PackedBatches`` yields."""

    windows_per_epoch = None  # generated: no epochs
    sources: list = []

    def __init__(
        self,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_sample: int = 0,
        split: str = "train",
    ):
        super().__init__()
        if seq_len < MIN_LENGTH:
            raise ValueError(f"data.synthetic=passkey needs model.seq_len >= {MIN_LENGTH}, got {seq_len}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size or start_sample % dp_size:
            raise ValueError(f"bad layout: dp_rank={dp_rank} dp_size={dp_size} start_sample={start_sample}")
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.start_sample, self.split = seed, start_sample, split

    def global_samples(self, k: int) -> list[int]:
        """Global sample indices of this rank's micro-batch k (counted from start_sample)."""
        first = self.start_sample // self.dp_size + k * self.micro_batch_size
        return [(first + t) * self.dp_size + self.dp_rank for t in range(self.micro_batch_size)]

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = sample_rng(self.seed, self.split, n)
        return training_example(passkey_sequence(self.seq_len, float(rng.random()), rng))

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        pairs = [self.sample(n) for n in self.global_samples(k)]
        tokens = torch.from_numpy(np.stack([t for t, _ in pairs]))
        labels = torch.from_numpy(np.stack([lab for _, lab in pairs]))
        positions = torch.arange(self.seq_len).expand_as(tokens).clone()
        return {"tokens": tokens, "labels": labels, "position_ids": positions, "skipped": torch.tensor(0)}

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        k = worker
        while True:
            yield self.batch(k)
            k += workers


def build_loader(
    task: str,
    split: str,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_sample: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    if task not in TASKS:
        raise ValueError(f"data.synthetic must be one of {TASKS}, got {task!r}")
    dataset = PasskeyBatches(seq_len, micro_batch_size, dp_rank, dp_size, seed, start_sample, split)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)


def source_dir(task: str, cache_dir: str | Path) -> Path:
    """A manifest-only directory describing the generator: the run's data contract (its digest) covers
    the task and its alphabet, as it covers a shard set's manifest."""
    if task not in TASKS:
        raise ValueError(f"data.synthetic must be one of {TASKS}, got {task!r}")
    out = Path(cache_dir).expanduser() / f"synthetic-{task}-v1"
    if not (out / MANIFEST_NAME).is_file():
        out.mkdir(parents=True, exist_ok=True)
        manifest = {
            "format": FORMAT,
            "vocab_size": VOCAB,
            "dtype": dtype_name(VOCAB),
            "tokenizer": None,
            "eos_id": EOS,
            "splits": {"train": [], "val": []},
            "synthetic": {
                "task": task,
                "digits": DIGITS,
                "ids": {"digit0": DIGIT0, "key": KEY, "key_end": KEY_END, "query": QUERY},
                "filler": [FILLER_START, FILLER_LEN],
            },
        }
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1))
    return out
