"""Byte-level BPE tokenizer trained offline with the `tokenizers` library.

Why: the built-in data set must not depend on downloading a pretrained tokenizer. Byte-level BPE
covers every input (no unknown tokens) and a small vocabulary trains in seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from goat_dist.atomic import atomic_write_text

EOS_TOKEN = "<|endoftext|>"
# 256 byte symbols + EOS is the smallest vocabulary a byte-level BPE can have.
MIN_VOCAB_SIZE = 257


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike) -> Tokenizer:
    """Train a byte-level BPE on `texts`, save it atomically as JSON at `out_path` and return it.

    The vocabulary holds EOS (id 0), the 256 byte symbols, then merges. The same texts give the
    same vocabulary and merges (the trainer breaks frequency ties deterministically).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + EOS), got {vocab_size}")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    atomic_write_text(out_path, tok.to_str())
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer.json; errors name the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exn:
        raise ValueError(f"invalid tokenizer file {path}: {exn}") from exn
    if tok.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"tokenizer file {path} has no {EOS_TOKEN} token")
    return tok


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-text token that terminates every document."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
    return i
