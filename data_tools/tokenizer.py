"""Byte-level BPE tokenizer trained offline with the `tokenizers` library, and the end-of-text token
of any tokenizer file.

Why: the built-in data set must not depend on downloading a pretrained tokenizer. Byte-level BPE
covers every input (no unknown tokens) and a small vocabulary trains in seconds. Pretrained
tokenizer files (GPT-2, Llama-2, Llama-3, ...) each end documents with their own token, so `prepare`
takes the one the file declares (`choose_eos`) unless told which.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME
from goat_dist.atomic import atomic_write_text, fsync_dir, temp_path_for

EOS_TOKEN = "<|endoftext|>"  # the end-of-text token `train_bpe` builds in
# End-of-text tokens of common tokenizer families, the preferred first: GPT-2/NeoX/Qwen, Llama-3 (base),
# Llama-2/Mistral/T5, Llama-3 (chat turn end), ChatML, Gemma. Llama-3 files hold both of theirs.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>", "<|im_end|>", "<eos>")
# 256 byte symbols + EOS is the smallest vocabulary a byte-level BPE can have.
MIN_VOCAB_SIZE = 257


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _exists_message(path: Path) -> str:
    message = f"{path} already exists (not replaced)"
    if path.name == TOKENIZER_NAME and (path.parent / MANIFEST_NAME).is_file():
        message += f": it is the tokenizer of the data set in {path.parent}"
    return message


def _write_new(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, but only if `path` does not exist (FileExistsError)."""
    tmp = temp_path_for(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if `path` exists, even if made meanwhile
        except FileExistsError:
            raise FileExistsError(_exists_message(path)) from None
        except OSError:  # a file system without hard links
            if path.exists():
                raise FileExistsError(_exists_message(path)) from None
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def train_bpe(
    texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike, *, overwrite: bool = False
) -> Tokenizer:
    """Train a byte-level BPE on `texts`, save it atomically as JSON at `out_path` and return it.

    An existing `out_path` is a FileExistsError naming it (checked before training) unless
    `overwrite`. The vocabulary holds EOS (id 0), the 256 byte symbols, then merges. The same texts
    give the same vocabulary and merges (the trainer breaks frequency ties deterministically).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + EOS), got {vocab_size}")
    out = Path(out_path)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a directory; name the tokenizer file to write")
    if out.exists() and not overwrite:  # before training: fail fast
        raise FileExistsError(_exists_message(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if overwrite:
        atomic_write_text(out, tok.to_str())
    else:
        _write_new(out, tok.to_str())
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer.json; errors name the path. Which token ends a document is `choose_eos`'s job."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exn:
        raise ValueError(f"invalid tokenizer file {path}: {exn}") from exn


def special_tokens(tok: Tokenizer) -> list[str]:
    """The tokenizer's special added tokens, in id order."""
    added = tok.get_added_tokens_decoder()
    return [added[i].content for i in sorted(added) if added[i].special]


def _appended_token(post: dict | None) -> str | None:
    """The special token a post-processor appends after a single sequence (`$A </s>`), if any: how the
    file itself ends a sequence."""
    if not isinstance(post, dict):
        return None
    kind = post.get("type")
    if kind == "Sequence":
        for p in reversed(post.get("processors") or []):
            token = _appended_token(p)
            if token is not None:
                return token
    elif kind == "TemplateProcessing":
        single = post.get("single") or []
        if len(single) > 1 and "SpecialToken" in single[-1] and any("Sequence" in p for p in single):
            return single[-1]["SpecialToken"]["id"]
    elif kind in ("BertProcessing", "RobertaProcessing"):
        return (post.get("sep") or [None])[0]
    return None


def find_eos_token(tok: Tokenizer) -> str | None:
    """The end-of-text token the tokenizer declares: the special token its post-processor appends to a
    sequence, else the first of EOS_CANDIDATES among its special tokens, else EOS_TOKEN if the vocabulary
    holds it at all; None when it declares none."""
    specials = set(special_tokens(tok))
    appended = _appended_token(json.loads(tok.to_str()).get("post_processor"))
    if appended in specials:
        return appended
    for token in EOS_CANDIDATES:
        if token in specials:
            return token
    return EOS_TOKEN if tok.token_to_id(EOS_TOKEN) is not None else None


def choose_eos(tok: Tokenizer, path: str | os.PathLike, eos_token: str | None = None) -> tuple[str, int]:
    """(token, id) that ends every document: `eos_token` when given, else the one the tokenizer file at
    `path` declares (`find_eos_token`). ValueError naming the file and the token when there is none."""
    have = special_tokens(tok)
    listing = ", ".join(have) if have else "none"
    if eos_token is not None:
        i = tok.token_to_id(eos_token)
        if i is None:
            raise ValueError(
                f"tokenizer file {path} has no token {eos_token!r} (--eos-token); "
                f"its special tokens: {listing}"
            )
        return eos_token, i
    token = find_eos_token(tok)
    if token is None:
        raise ValueError(
            f"tokenizer file {path} declares no end-of-text token (none of {', '.join(EOS_CANDIDATES)}; "
            f"its special tokens: {listing}): pass --eos-token with the token that ends a document"
        )
    return token, tok.token_to_id(token)


def eos_id(tok: Tokenizer, token: str | None = None) -> int:
    """Id of the end-of-text token that terminates every document (`token`, or the declared one)."""
    if token is None:
        token = find_eos_token(tok)
        if token is None:
            raise ValueError("tokenizer declares no end-of-text token")
    i = tok.token_to_id(token)
    if i is None:
        raise ValueError(f"tokenizer has no {token!r} token")
    return i
