"""BOS framing (``data.bos_framing``): every window is one BOS token and ``seq_len - 1`` corpus tokens.

Why: the authors' C4 script (``train_c4.py``) prepends a BOS to every block of ``L - 1`` tokens, so
position 0 of every window holds the same token. A GOAT model gets its sink lane and the token-0 bump
``sink_bump * [t == 0]``; both meet the same token at t = 0 in every window instead of an arbitrary
word, so a comparison with the authors' numbers trains on their windows. Off by default (goat-dist's
packed windows start anywhere in the stream).

The cut, for a window length L (``seq_len``, or an evaluation length):

* unframed: window w reads stream tokens ``[w L, w L + L + 1)`` (stride L);
  ``tokens = x[:-1]``, ``labels = x[1:]``;
* framed: window w reads ``[w (L-1), w (L-1) + L)`` (stride L - 1, L tokens), and
  ``tokens = [BOS, x_0 .. x_{L-2}]``, ``labels = [x_0 .. x_{L-1}]``: the BOS position predicts the
  block's first corpus token, every corpus token the next one, the last position the first token of the
  next block (as the unframed last position does), and no position predicts a BOS. Every window keeps L
  inputs and L targets, so batch shapes, token counts and the loss's denominator do not change. (A
  Hugging Face ``labels=input_ids`` loss on the authors' L-token windows scores L - 1 of them and
  drops the last position's target; the difference is one target in L.)

The stride is the schedule's ``seq_len`` (``stride``), so everything that turns a sample into stream
offsets (the schedule, the loader, ``trainer.nonfinite.describe_sample``) reads framed windows unchanged.

The BOS token (``bos_id``): the manifest's ``bos_id`` where a data set records one; else the special
token the data set's tokenizer file puts before a single sequence (its post-processor: Llama's ``<s>``,
Llama 3's ``<|begin_of_text|>``, BERT's ``[CLS]``); else the data set's EOS, the token every document
already ends with (GPT-2 has no BOS: the authors use ``<|endoftext|>``). A function of the manifest and
the tokenizer file, both in the data contract (manifest digest, ``tokenizer_sha256``); a data set
missing its tokenizer file is refused rather than framed with its EOS.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from data_tools.shard_format import TOKENIZER_NAME, locate
from goat_dist.data.shards import is_url, open_shard
from goat_dist.data.sources import SourceSplit, load_manifest


def stride(seq_len: int, bos_framing: bool) -> int:
    """Corpus tokens each window advances by: ``seq_len``, or ``seq_len - 1`` when a BOS takes a slot."""
    if bos_framing and seq_len < 2:
        raise ValueError(
            f"BOS framing needs windows of >= 2 tokens (a BOS and a corpus token), got {seq_len}"
        )
    return seq_len - 1 if bos_framing else seq_len


def cut(window: np.ndarray, tokens: np.ndarray, labels: np.ndarray, bos: int | None) -> None:
    """Fill one row's ``tokens`` and ``labels`` (L each) from the ``stride + 1`` stream tokens it read;
    ``bos`` None: unframed."""
    if bos is None:
        tokens[:] = window[:-1]
        labels[:] = window[1:]
        return
    tokens[0] = bos
    tokens[1:] = window[:-1]
    labels[:] = window


def unreadable(missing: np.ndarray, framed: bool) -> np.ndarray:
    """Positions (L,) whose input or target is an unreadable stream token (``missing``, stride + 1 long):
    their labels are ignored. Framed, input t >= 1 is stream token t - 1 and target t is token t (the BOS
    is never missing)."""
    if not framed:
        return missing[:-1] | missing[1:]
    out = missing.copy()
    out[1:] |= missing[:-1]
    return out


def bos_id(split: SourceSplit) -> int:
    """The token that opens every framed window of ``split``'s data set (see the module docstring)."""
    return _bos_id(split.path, split.eos_id, split.tokenizer_sha256)


@functools.lru_cache(maxsize=16)
def _bos_id(path: str, eos_id: int, tokenizer_sha256: str | None) -> int:
    manifest = load_manifest(path)
    if isinstance(manifest.get("bos_id"), int):
        return int(manifest["bos_id"])
    where = locate(path, manifest.get("tokenizer") or TOKENIZER_NAME)
    try:
        if is_url(path):
            f = open_shard(where)
            try:
                text = f.read()
            finally:
                f.close()
        else:
            with open(where, "rb") as f:
                text = f.read()
        post = json.loads(text).get("post_processor")
    except FileNotFoundError:
        # no silent fallback: the same data set elsewhere, with its tokenizer, would frame another token
        raise ValueError(
            f"data.bos_framing: the tokenizer file {where} of data set {path} is missing, and the window's "
            'BOS is the tokenizer\'s; restore the file, or record the token as "bos_id" in its manifest'
        ) from None
    prefix = prepended_token(post)
    return eos_id if prefix is None else prefix


def prepended_token(post: dict | None) -> int | None:
    """The id of the special token a Hugging Face ``tokenizers`` post-processor puts before a single
    sequence (``<s> $A``), if any: how the tokenizer file itself starts a sequence."""
    if not isinstance(post, dict):
        return None
    kind = post.get("type")
    if kind == "Sequence":
        for p in post.get("processors") or []:
            found = prepended_token(p)
            if found is not None:
                return found
    elif kind == "TemplateProcessing":
        single = post.get("single") or []
        if len(single) > 1 and "SpecialToken" in single[0]:
            name = single[0]["SpecialToken"]["id"]
            ids = ((post.get("special_tokens") or {}).get(name) or {}).get("ids") or []
            return int(ids[0]) if len(ids) == 1 else None
    elif kind in ("BertProcessing", "RobertaProcessing"):
        cls = post.get("cls") or []
        return int(cls[1]) if len(cls) == 2 else None
    return None
