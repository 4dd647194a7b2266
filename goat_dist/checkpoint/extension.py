"""A new run from another run's weights (``train.init_from``): the stages of long-context pretraining.

Stage 2 (say 16k tokens, CP=4, its own data and LR schedule) starts at step 0 from stage 1's checkpoint
(2k tokens, DP=8): the weights (and with ``train.init_optimizer=true`` Adam's moments and step count)
come from the checkpoint's layout-independent ``universal/`` state, re-split for the new layout; run
state, data position and LR schedule start fresh. A run that has a checkpoint of its own resumes it
instead (``train.resume``), so a preempted stage 2 continues stage 2.

GOAT's sink features divide positions by ``L_train`` (``model.goat.train_len``). That normaliser is part
of the learned function: an extension keeps the checkpoint's value unless the config sets one, and says
so when it does (``resolve_train_len``).

The lanes GOAT's u(j) takes (``model.goat.key_bias_lanes``: auto is 1 under fp32, 3 under bf16) set the
q/k content width, so they are resolved with the run's precision before the model is built; auto keeps a
checkpoint's count where it is exact, and a start whose checkpoint has another count is refused naming
the key and both counts (``resolve_key_bias_lanes``) rather than failing on a tensor shape.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import yaml

from .digests import raise_everywhere
from .errors import CheckpointError


def saved_train_len(step_dir: Path) -> int | None:
    """The L_train a checkpoint's model was trained with: its config's ``model.goat.train_len``, or (for
    checkpoints from before that key) its ``model.seq_len``."""
    path = Path(step_dir) / "config.yaml"
    if not path.is_file():
        return None
    model = (yaml.safe_load(path.read_text()) or {}).get("model", {})
    return (model.get("goat") or {}).get("train_len") or model.get("seq_len")


def resolve_train_len(cfg, start: Path | None, log=print) -> int:
    """Fill ``cfg.model.goat.train_len`` before the model is built: the config's value, else that of the
    checkpoint the run resumes or starts from, else ``model.seq_len``."""
    g = cfg.model.goat
    saved = saved_train_len(start) if start is not None else None
    if g.train_len is None:
        g.train_len = saved or cfg.model.seq_len
    elif saved is not None and saved != g.train_len:
        log(
            f"model.goat.train_len={g.train_len} (set in the config) replaces {saved} of {start}: "
            "GOAT's sink features change scale"
        )
    return g.train_len


def saved_key_bias_lanes(step_dir: Path) -> int | None:
    """u(j)'s lanes in a checkpoint's GOAT model (with the sink): its config's ``model.goat.key_bias_lanes``,
    3 for a checkpoint from before the key; None for another model or no readable config."""
    from ..shapes import KEY_BIAS_LANES
    from .compat import saved_model

    model = saved_model(step_dir)
    goat = (model or {}).get("goat") or {}
    if model is None or model.get("position", "goat") != "goat" or not goat.get("key_bias", True):
        return None
    value = goat.get("key_bias_lanes", "auto")
    return KEY_BIAS_LANES if value == "auto" else int(value)


def resolve_key_bias_lanes(cfg, resume: Path | None, init_from: Path | None = None, log=print) -> int:
    """Fill ``cfg.model.goat.key_bias_lanes`` before the model is built (``train.precision`` must be
    resolved). ``auto``: the count of the checkpoint the run resumes (``resume``) or starts from
    (``init_from``) when it is exact under this precision (3 anywhere, 1 under fp32), else the
    precision's (``shapes.key_lanes_for``). A checkpoint with another count than the result is a
    CheckpointError naming the key and both lane counts: its q/k projections have another shape, and no
    conversion keeps the function (the content scale ``1/sqrt(d_c)`` changes with the width)."""
    from ..shapes import KEY_BIAS_LANES, key_lanes_for
    from ..shapes import resolve_key_bias_lanes as resolve
    from .compat import INIT_FROM, RESUME, _where

    m, precision = cfg.model, cfg.train.precision
    given = m.goat.key_bias_lanes
    if m.position != "goat" or not m.goat.key_bias:
        return resolve(m, precision)
    start, purpose = (resume, RESUME) if resume is not None else (init_from, INIT_FROM)
    saved = saved_key_bias_lanes(start) if start is not None else None
    if given == "auto" and saved is not None and (saved == KEY_BIAS_LANES or precision == "fp32"):
        m.goat.key_bias_lanes = saved  # the checkpoint's shapes, exact under this precision too
        if saved != key_lanes_for(precision):
            log(f"model.goat.key_bias_lanes=auto keeps the {saved} u(j) lanes of {start} under {precision}")
    lanes = resolve(m, precision)
    if saved is not None and saved != lanes:
        R = m.goat.pos_rank
        why = f"auto under train.precision={precision}" if given == "auto" else "set in the config"
        keep = (
            "(it stays exact)"
            if saved == KEY_BIAS_LANES or precision == "fp32"
            else f"(u(j) then rides one {precision} lane, as in the authors' code: its rounding grows with "
            "the sequence length), or train.precision=fp32"
        )
        new = "train it in a new run.dir" if purpose == RESUME else "leave train.init_from out"
        raise CheckpointError(
            f"{_where(start, purpose)}: model.goat.key_bias_lanes is {saved} there ({2 * R + saved} = "
            f"2R+{saved} prior lanes per q/k head) and {lanes} here ({2 * R + lanes} = 2R+{lanes}, {why}), "
            f"so its q/k projections have another shape. Set model.goat.key_bias_lanes={saved} to continue "
            f"it {keep}; for {lanes} lanes {new}"
        )
    if lanes < KEY_BIAS_LANES and precision != "fp32":
        log(
            f"model.goat.key_bias_lanes={lanes} under train.precision={precision}: u(j) is rounded to "
            f"{precision} once, as in the authors' code (its error grows with the sequence length); "
            f"{KEY_BIAS_LANES} lanes keep it exact"
        )
    return lanes


def agree_on_source(init_from: str) -> Path:
    """Collective: the step directory ``train.init_from`` names (a step dir, or a run / checkpoints dir and
    its latest), resolved on rank 0 and checked on every rank."""
    from .export import resolve_step_dir
    from .resume import agree_on_checkpoint

    mine = ""
    error = ""
    if dist.get_rank() == 0:
        try:
            mine = str(resolve_step_dir(init_from))
        except CheckpointError as e:
            error = f"train.init_from={init_from}: {e}"
    raise_everywhere(error)
    return agree_on_checkpoint(mine, lambda: None, key="train.init_from")  # an error names that key


def init_weights(engine, model, step_dir: Path, optimizer: bool, contract: dict | None = None) -> dict:
    """Collective: this run's weights (and with ``optimizer`` Adam's moments and step count) from
    ``step_dir``'s universal state; the run's own step, data and LR schedule are untouched.

    A checkpoint of another model shape is refused naming the config keys that differ; with ``contract``
    (this run's data contract) one trained with another tokenizer is refused (``compat``)."""
    from . import compat, universal
    from .manager import read_run_files

    step_dir = Path(step_dir)
    # the manifest and run state, checked as read; the state's files are checked by the ranks reading them
    manifest, state, _ = read_run_files(step_dir, None, "start train.init_from from it")
    step = state["step"]
    current = getattr(model, "cfg", None)  # the model's ModelConfig
    compat.check_tokenizer(step_dir, state, contract, current, compat.INIT_FROM)
    keys = universal.KEYS if optimizer else ("",)
    try:
        universal.load(
            engine,
            model,
            step_dir,
            step,
            keys=keys,
            adam_step=step if optimizer else 0,
            schedule=False,
            manifest=manifest,
        )
    except universal.ModelMismatch as e:
        raise CheckpointError(compat.model_change(step_dir, current, e.problems, compat.INIT_FROM)) from None
    return {"path": str(step_dir), "step": step, "optimizer": optimizer}
