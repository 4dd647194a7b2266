"""Is the evaluated data the model's own vocabulary? And where do its results go?

A perplexity is only a number about the model when the evaluated tokens are ids of the tokenizer the
model was trained with. Data of a larger vocabulary holds ids the model has no embedding for; data of
another tokenizer of the same size gives a perplexity of nothing. So the data set's manifest
(``vocab_size``, ``tokenizer_sha256``) is compared with what training recorded: the checkpoint's data
contract (``trainer_state.json``; the tokenizer of every training source), or for an export directory
the sha256 of the ``tokenizer.json`` exported with the weights. A larger vocabulary is refused always;
another tokenizer unless ``--allow-other-tokenizer`` (the report then says so). Without any record
(a checkpoint from before data contracts, an export without a tokenizer) the report says the tokenizer
was not verified.

Results are kept per data set: ``ppl_<name>-<manifest digest>_<split>.json``, so evaluating another data
set never replaces an earlier one's numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import EvalError

ALLOW_FLAG = "--allow-other-tokenizer"


def trained_tokenizers(loaded) -> tuple[list[str] | None, str]:
    """(the tokenizer_sha256 values training recorded, where they were read); None when nothing records
    them."""
    from data_tools.shard_format import TOKENIZER_NAME

    from ..atomic import sha256_file
    from ..checkpoint.names import STATE

    source = Path(loaded.source)
    state = source / STATE
    if state.is_file():
        try:
            contract = json.loads(state.read_text()).get("data_contract") or {}
        except (OSError, ValueError):
            contract = {}
        shas = contract.get("tokenizer_sha256")
        if shas:
            return (list(shas) if isinstance(shas, list) else [shas]), f"the data contract in {state}"
    tokenizer = source / TOKENIZER_NAME
    if tokenizer.is_file():
        return [sha256_file(tokenizer)], f"the exported {tokenizer}"
    return None, f"{source} records no tokenizer"


def check_data(loaded, data: str, manifest: dict, allow_other: bool) -> dict:
    """The evaluated data set fits the model: its ids within the model's vocabulary (always) and made by
    the training tokenizer (unless ``allow_other``). Returns what the report records about it; raises
    EvalError naming the data set, both values and the fix."""
    from ..data.contract import digest

    vocab, model_vocab = manifest["vocab_size"], loaded.cfg.vocab_size
    if vocab > model_vocab:
        raise EvalError(
            f"{data} was tokenized with vocab_size {vocab}, but the model has {model_vocab} token ids "
            f"(model.vocab_size of {loaded.source}): its ids {model_vocab}..{vocab - 1} do not exist in "
            "this model. Evaluate on data prepared with the run's tokenizer "
            "(`goat-dist data prepare --tokenizer <the tokenizer.json of the run's data>`)"
        )
    sha = manifest.get("tokenizer_sha256")
    trained, where = trained_tokenizers(loaded)
    if trained is None or sha is None:
        check = f"unverified: {where}" if trained is None else f"unverified: {data} records no tokenizer"
    elif sha in trained:
        check = "same as training"
    elif allow_other:
        check = f"other than training ({ALLOW_FLAG})"
    else:
        raise EvalError(
            f"{data} was tokenized with another tokenizer than the model was trained with (tokenizer_sha256 "
            f"{sha[:16]}..., training: {', '.join(t[:16] + '...' for t in trained)} from {where}): its "
            "token ids mean other text to this model and its perplexity would measure nothing. Evaluate on "
            "data prepared with the run's tokenizer (`goat-dist data prepare --tokenizer <the tokenizer.json "
            f"of the run's data>`), or pass {ALLOW_FLAG} to measure it anyway"
        )
    return {
        "data_vocab_size": vocab,
        "data_manifest_sha256": digest(manifest),
        "tokenizer_sha256": sha,
        "trained_tokenizer_sha256": trained,
        "tokenizer_check": check,
    }


def data_label(data: str, digest: str) -> str:
    """A file-name-safe label of one data set: its directory's name (or a URL's last part) and the first
    8 hex digits of its manifest digest, so two data sets of the same name stay apart."""
    name = data.split("{}")[0].rstrip("/-_. ").rsplit("/", 1)[-1]  # a URL prefix: the part before {}
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "data"
    return f"{name[:60]}-{digest[:8]}"


def ppl_stem(report: dict) -> str:
    """``ppl_<data label>_<split>``: the file name (without suffix) of one data set's perplexity results."""
    split = re.sub(r"[^A-Za-z0-9._-]+", "-", report["split"])
    return f"ppl_{data_label(report['data'], report['data_manifest_sha256'])}_{split}"
