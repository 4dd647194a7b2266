"""Whether a checkpoint's weights fit this run, said as the settings that changed.

Why: a resume or ``train.init_from`` into another model used to stop at the first tensor that did not fit
("no parameter blocks.2.attn_norm.weight"), naming a tensor rather than the change (``model.num_layers
2 -> 3``). And a tokenizer change surfaced as a data-contract change whose suggested fix,
``train.data_resume=restart``, would keep training embeddings whose rows belong to other strings.

The checkpoint's own ``config.yaml`` is compared with this run's model section (``model_changes``) once
its tensors are known not to fit (``universal.ModelMismatch``); the data contract's ``tokenizer_sha256``
(``trainer_state.json``) with this run's, before anything is loaded (``check_tokenizer``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .errors import CheckpointError

# the model settings that decide which tensors a model has and their shapes (``seq_len`` too under
# ``position=learned``: the position table); any other model.* key can change across a resume
SHAPE_KEYS = (
    "vocab_size",
    "vocab_pad_multiple",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "activation",
    "norm",
    "bias",
    "tie_embeddings",
    "position",
    "goat.pos_rank",
    "goat.abs_rank",
    "goat.key_bias",
    "goat.key_bias_lanes",  # u(j)'s lanes: the q/k content width (compared as the count it builds)
)
RESUME, INIT_FROM = "resume", "init_from"


def _flat(model: dict) -> dict:
    """A model section as ``{key: value}`` with ``goat.*`` keys, over the defaults (older configs lack
    keys added since)."""
    from ..config import GoatConfig, ModelConfig
    from ..shapes import key_bias_lanes

    merged = dataclasses.asdict(ModelConfig())
    goat = {**merged.pop("goat"), **(model.get("goat") or {})}
    merged.update({k: v for k, v in model.items() if k != "goat"})
    # the lanes u(j) takes, only where they shape q/k (a GOAT model with the sink); auto (an older
    # checkpoint, or no precision known) builds 3
    lanes = key_bias_lanes(GoatConfig(key_bias_lanes=goat.get("key_bias_lanes", "auto")))
    goat["key_bias_lanes"] = lanes if merged.get("position") == "goat" and goat.get("key_bias") else None
    return {**merged, **{f"goat.{k}": v for k, v in goat.items()}}


def saved_model(step_dir: Path) -> dict | None:
    """The model section of the checkpoint's ``config.yaml`` (None when it has none)."""
    path = Path(step_dir) / "config.yaml"
    try:
        model = (yaml.safe_load(path.read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError):
        return None
    return model if isinstance(model, dict) else None


def model_changes(saved: dict, current) -> list[str]:
    """``model.KEY old -> new`` for every shape key that differs between the checkpoint's model section
    (a dict) and this run's (a ``ModelConfig`` or a dict)."""
    now = current if isinstance(current, dict) else dataclasses.asdict(current)
    old, new = _flat(saved), _flat(now)
    keys = list(SHAPE_KEYS)
    if "learned" in (old["position"], new["position"]):
        keys.insert(keys.index("position") + 1, "seq_len")
    return [f"model.{k} {old.get(k)} -> {new.get(k)}" for k in keys if old.get(k) != new.get(k)]


def _where(step_dir: Path, purpose: str) -> str:
    return f"cannot resume from {step_dir}" if purpose == RESUME else f"train.init_from={step_dir}"


def model_change(step_dir: Path, current, problems: list[str], purpose: str) -> str:
    """The one message for a checkpoint whose tensors do not fit this model: the config keys that differ
    (the tensors only when no key explains them) and the fix."""
    saved = saved_model(step_dir)
    changes = model_changes(saved, current) if saved is not None and current is not None else []
    if changes:
        what = f"its model differs from this run's: {', '.join(changes)} (the checkpoint's -> this run's)"
        keys = ", ".join(c.split(" ")[0] for c in changes)
    else:
        what = "its tensors are not this model's: " + "; ".join(problems[:3])
        keys = "the model section"
    vocab = any(c.startswith("model.vocab_size ") for c in changes)
    why = ". The vocabulary changed: its embeddings belong to another tokenizer" if vocab else ""
    if purpose == RESUME:
        fix = (
            f"A resume continues the model it saved: set {keys} back to resume it, or train the new model "
            "in a new run.dir (train.init_from cannot carry weights into other shapes either)"
        )
    else:
        fix = (
            f"train.init_from carries weights into a model of the same shapes only: set {keys} as the "
            "checkpoint has them, or leave train.init_from out to train this model from scratch"
        )
    return f"{_where(step_dir, purpose)}: {what}{why}. {fix}"


def _tokenizers(contract: dict | None) -> list[str] | None:
    found = (contract or {}).get("tokenizer_sha256")
    if not found:
        return None
    return sorted(found) if isinstance(found, (list, tuple)) else [found]


def check_tokenizer(step_dir: Path, state: dict, contract: dict | None, current, purpose: str) -> None:
    """A CheckpointError when the checkpoint's data contract names another tokenizer than this run's
    (``contract``): its embedding rows belong to other strings, which no data setting repairs."""
    old, new = _tokenizers(state.get("data_contract")), _tokenizers(contract)
    if old is None or new is None or old == new:
        return
    saved = saved_model(step_dir)
    vocab = [
        c
        for c in (model_changes(saved, current) if saved and current is not None else [])
        if c.startswith("model.vocab_size ")
    ]
    shas = f"tokenizer_sha256 {', '.join(s[:12] for s in old)} -> {', '.join(s[:12] for s in new)}"
    if purpose == RESUME:
        fix = (
            "A token id means another string in this run's data, so neither a resume nor "
            "train.data_resume=restart would train a sound model. Resume with data of the checkpoint's "
            "tokenizer, or train a model for the new tokenizer from scratch in a new run.dir"
        )
    else:
        fix = (
            "A token id means another string in this run's data. Start from a checkpoint trained with this "
            "tokenizer, or leave train.init_from out to train from scratch"
        )
    changed = "; ".join([shas, *vocab])
    where = _where(step_dir, purpose)
    raise CheckpointError(f"{where}: its embeddings belong to another tokenizer ({changed}). {fix}")
