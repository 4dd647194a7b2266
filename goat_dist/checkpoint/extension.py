"""A new run from another run's weights (``train.init_from``): the stages of long-context pretraining.

Stage 2 (say 16k tokens, CP=4, its own data and LR schedule) starts at step 0 from stage 1's checkpoint
(2k tokens, DP=8): the weights (and with ``train.init_optimizer=true`` Adam's moments and step count)
come from the checkpoint's layout-independent ``universal/`` state, re-split for the new layout; run
state, data position and LR schedule start fresh. A run that has a checkpoint of its own resumes it
instead (``train.resume``), so a preempted stage 2 continues stage 2.

GOAT's sink features divide positions by ``L_train`` (``model.goat.train_len``). That normaliser is part
of the learned function: an extension keeps the checkpoint's value unless the config sets one, and says
so when it does (``resolve_train_len``).
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
