"""The run's config, resolved once: every value a run derives (its precision, GOAT's L_train and key lanes,
the window order a resumed stream keeps) is fixed here, before the model is built and before anything is
written, and the config is then read-only (``config.Section``). The run directory's config.yaml is this
config, so it can never disagree with what the run does."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import extension
from ..checkpoint.names import STATE
from ..config import Config
from ..data import contract as data_contract
from ..precision import resolve_precision


def saved_data_contract(step_dir: Path | None) -> dict | None:
    """The data contract a checkpoint records (its trainer_state.json), None without one (a new run, or a
    checkpoint from before contracts). Unreadable: None here; the resume itself then names the file."""
    if step_dir is None:
        return None
    try:
        return json.loads((Path(step_dir) / STATE).read_text()).get("data_contract")
    except (OSError, ValueError):
        return None


def saved_consumed_samples(step_dir: Path | None) -> int:
    """The samples a checkpoint had consumed (its trainer_state.json), 0 without one (a new run).
    Unreadable: 0 here; the resume itself then names the file."""
    if step_dir is None:
        return 0
    try:
        consumed = json.loads((Path(step_dir) / STATE).read_text())["run_state"]["consumed_samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return consumed if type(consumed) is int and consumed >= 0 else 0


def resolve_run_config(
    cfg: Config, device, start: Path | None, init_source: Path | None, log=print
) -> tuple[Config, str | None]:
    """``cfg`` resolved in place for a run on ``device`` that resumes ``start`` (None: a new run, whose
    weights may come from ``init_source``), then made read-only. Returns it, and the window order a resumed
    stream keeps when that differs from the configured one (else None), for the trainer to say so.

    In this order: ``train.precision`` (auto -> bf16 on CUDA, fp32 elsewhere); ``model.goat.train_len``
    (the config's, else the start's, else ``model.seq_len``); GOAT's key lanes (needs the precision);
    ``data.window_order`` (the order the resumed stream began with, ``data/contract.py``)."""
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    extension.resolve_train_len(cfg, start or init_source, log)
    extension.resolve_key_bias_lanes(cfg, start, init_source, log)  # after the precision
    kept = None
    if start is not None:
        kept = data_contract.kept_window_order(saved_data_contract(start), cfg)
        if kept is not None:
            cfg.data.window_order = kept
    return cfg.frozen(), kept
