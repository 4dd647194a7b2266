"""``goat-dist train``'s entry point: run the trainer, tear the process groups down, and record how the
process ended (``last_exit.json``) for the job script that decides whether to requeue."""

from __future__ import annotations

import json
import os
import time

from .. import distributed
from ..atomic import atomic_write_text
from ..checkpoint import CheckpointError
from ..config import Config
from ..distributed import LayoutError
from . import data_contract, nonfinite
from .deadline import DeadlineError
from .signals import EXIT_CHECKPOINTED
from .state import RunState
from .trainer import Trainer


def run(cfg: Config) -> RunState:
    """Entry point of ``goat-dist train``: train, then tear the process groups down cleanly.

    Rank 0 records how the process ended in ``<run_dir>/last_exit.json`` (``status`` finished,
    checkpointed or failed, ``reason``, ``step``, ``exit_code``): a job script decides on requeueing from
    it, since a launcher such as torchrun replaces the workers' exit codes with its own."""
    trainer = None
    try:
        trainer = Trainer(cfg)
        state = trainer.fit()
    except BaseException as e:
        distributed.teardown(barrier=False)
        step = trainer.state.step if trainer is not None else None
        _record_exit(cfg, "failed", f"{type(e).__name__}: {e}", step, exit_code_for(e))
        raise
    distributed.teardown()
    if state.stop_requested:
        _record_exit(cfg, "checkpointed", state.stop_requested, state.step, EXIT_CHECKPOINTED)
    else:
        _record_exit(cfg, "finished", None, state.step, 0)
    return state


# errors that are the user's to fix (config, layout, checkpoint, data): exit 2, like a usage error
USER_ERRORS = (
    LayoutError,
    CheckpointError,
    data_contract.DataContractError,
    nonfinite.NonFiniteError,
    DeadlineError,
)


def exit_code_for(error: BaseException) -> int:
    return 2 if isinstance(error, USER_ERRORS) else 1


def _record_exit(cfg: Config, status: str, reason: str | None, step: int | None, exit_code: int) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    record = {"status": status, "reason": reason, "step": step, "exit_code": exit_code, "time": time.time()}
    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cfg.run_dir / "last_exit.json", json.dumps(record, indent=1))
    except OSError as e:  # never mask the run's own error
        print(f"could not write {cfg.run_dir / 'last_exit.json'}: {e}")
