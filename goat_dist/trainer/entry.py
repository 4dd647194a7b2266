"""``goat-dist train``'s entry point: run the trainer, tear the process groups down, and record how the
process ended (``last_exit.json``) for the job script that decides whether to requeue."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from data_tools.shard_format import ShardError

from .. import distributed
from ..atomic import atomic_write_text
from ..checkpoint import CheckpointError
from ..config import Config, ConfigError
from ..data import contract as data_contract
from ..data.batches import check_sources
from ..distributed import LayoutError
from ..parallel.timeouts import Timeouts
from ..run_lock import RunDirError, WorldLock
from . import nonfinite
from .deadline import DeadlineError
from .signals import EXIT_ABORTED, EXIT_CHECKPOINTED
from .state import RunState
from .trainer import Trainer


def run(cfg: Config) -> RunState:
    """Entry point of ``goat-dist train``: train, then tear the process groups down cleanly.

    First rank 0 takes the run dir's lock (``run_lock``: one live trainer per run dir) and marks the
    attempt ``running`` in ``<run_dir>/last_exit.json``; with more ranks, every rank waits for that in
    the run's first collective, and a refusal ends every rank with exit 2 before anything is written.

    Rank 0 records how the process ended in ``<run_dir>/last_exit.json`` (``status`` finished,
    checkpointed or failed, ``reason``, ``step``, ``exit_code``): a job script decides on requeueing from
    it, since a launcher such as torchrun replaces the workers' exit codes with its own. A record that
    still says ``running`` after the process is gone was left by a process that was killed.

    After a finished or checkpointed run the record is written (and fsynced) before the final barrier,
    so it is on disk before any rank can exit: ``srun --kill-on-bad-exit=1`` ends a whole step when one
    task exits non-zero, and a rank 0 still writing would die without a record. For the same reason
    only rank 0 exits 75 after a checkpointed stop (``process_exit_code``, which the command line exits
    with); the other ranks exit 0. The lock is released last."""
    trainer = None
    excepthook = sys.excepthook
    lock = WorldLock(cfg)
    try:
        lock.hold()
        check_data_sources(cfg)
        trainer = Trainer(cfg)
        state = trainer.fit()
    except BaseException as e:
        distributed.teardown(barrier=False)
        if _world() == 1:  # torch.distributed prefixes "[rank0]: " to every traceback line
            sys.excepthook = excepthook
        step = trainer.state.step if trainer is not None else None
        lost = collective_failure(e, cfg, trainer)
        reason = lost or f"{type(e).__name__}: {e}"
        if lock.held:  # never into the run dir of another trainer, nor one that cannot be written
            _record_exit(cfg, "failed", reason, step, exit_code_for(e), any_rank=lost is not None)
        lock.release()
        raise
    if state.stop_requested:
        _record_exit(cfg, "checkpointed", state.stop_requested, state.step, EXIT_CHECKPOINTED)
    else:
        _record_exit(cfg, "finished", None, state.step, 0)
    distributed.teardown()  # its barrier: no rank leaves before rank 0's record is on disk
    lock.release()
    return state


def collective_failure(error: BaseException, cfg: Config, trainer: Trainer | None) -> str | None:
    """``distributed.collective_failure``'s reason, naming the timeout that applied: the start-up one
    (``parallel.startup_timeout_minutes``) until this rank's first step ended (a trainer not yet built, or
    the run lock's collective, count as before it), else ``parallel.timeout_minutes``."""
    timeouts = trainer.timeouts if trainer is not None else Timeouts.from_config(cfg.parallel)
    applied = timeouts.describe()
    if not timeouts.steady:
        applied += ", the start-up timeout: this rank's first step had not ended"
    return distributed.collective_failure(error, applied)


def process_exit_code(state: RunState) -> int:
    """This process's exit code after a run that did not fail: 0, or ``EXIT_CHECKPOINTED`` (75) on rank 0
    after a checkpointed stop. The record carries 75 for the whole world; a non-zero code from another
    rank would make ``srun --kill-on-bad-exit=1`` kill rank 0 (and torchrun stop it) while it exits."""
    if state.stop_requested and _rank() == 0:
        return EXIT_CHECKPOINTED
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# errors that are the user's to fix (config, layout, checkpoint, data): exit 2, like a usage error
USER_ERRORS = (
    ConfigError,
    LayoutError,
    CheckpointError,
    ShardError,
    data_contract.DataContractError,
    nonfinite.NonFiniteError,
    DeadlineError,
    RunDirError,
)

# kinds every rank raises alike (they depend on the config and the world size only, or rank 0 told every
# rank: the run dir's lock): rank 0 speaks for all
SAME_ON_EVERY_RANK = (ConfigError, LayoutError, RunDirError)

# how long a rank other than 0 waits for rank 0 to report the same error before reporting its own
QUIET_RANK_GRACE_S = 5.0

_STARTED = time.time()


def exit_code_for(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return EXIT_ABORTED
    return 2 if isinstance(error, USER_ERRORS) else 1


def check_data_sources(cfg: Config) -> None:
    """The configured local data sets, checked before any model exists (after the run dir's lock)
    (``batches.check_sources``: present, one tokenizer, a validation split when evaluating, every shard on
    disk at its recorded size), in words that name the setting and the fix."""
    check_sources(cfg)


def user_error_message(error: BaseException, prog: str = "goat-dist train") -> str:
    """One block of text for an error of the user's: the message, and the fix where the message alone
    does not say it. An error re-raised from a DataLoader worker carries the worker's traceback in its
    text; only its last line is the message."""
    text = str(error)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith(type(error).__name__) else last
    if isinstance(error, ShardError) and "on_error" not in text:
        text += (
            "\n  fix: rebuild the data set (`goat-dist data prepare`; `goat-dist data inspect DIR` checks "
            "every shard), or set data.on_error=skip to mask the damaged samples and go on"
        )
    return f"{prog}: {text}"


def report_user_error(
    error: BaseException, run_dir: Path | None = None, prog: str = "goat-dist train"
) -> int:
    """Print ``error`` once for the whole world and return its exit code.

    Rank 0 prints at once. Another rank stays quiet for errors every rank raises alike; for the others
    (data, checkpoint: possibly this rank's alone) it waits ``QUIET_RANK_GRACE_S`` for rank 0's
    ``last_exit.json`` to name the same error: a launcher that stops the world when rank 0 exits ends the
    wait early (SIGTERM does so again, whatever handler the run had installed). ``GOAT_DEBUG=1`` adds the
    traceback."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        if isinstance(error, SAME_ON_EVERY_RANK) or _rank0_reported(error, run_dir):
            return exit_code_for(error)
    message = user_error_message(error, prog)
    if rank != 0:
        message = f"[rank {rank}] {message}"
    if os.environ.get("GOAT_DEBUG", "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    print(message, file=sys.stderr, flush=True)
    return exit_code_for(error)


def _failure_recorded(run_dir: Path) -> bool:
    """Within ``QUIET_RANK_GRACE_S``, a ``failed`` record of this run appears in ``last_exit.json``."""
    deadline = time.monotonic() + QUIET_RANK_GRACE_S
    while time.monotonic() < deadline:
        try:
            record = json.loads((Path(run_dir) / "last_exit.json").read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("time", 0) >= _STARTED and record.get("status") == "failed":
            return True
        time.sleep(0.2)
    return False


def _rank0_reported(error: BaseException, run_dir: Path | None) -> bool:
    if run_dir is None:
        return False
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    reason = f"{type(error).__name__}: {error}"
    deadline = time.monotonic() + QUIET_RANK_GRACE_S
    while time.monotonic() < deadline:
        try:
            record = json.loads((Path(run_dir) / "last_exit.json").read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("time", 0) >= _STARTED and record.get("status") == "failed":
            return record.get("reason") == reason
        time.sleep(0.2)
    return False


def _record_exit(
    cfg: Config, status: str, reason: str | None, step: int | None, exit_code: int, any_rank: bool = False
) -> None:
    """Rank 0 writes the record. With ``any_rank`` (a collective that lost a peer: rank 0 itself may be
    the frozen or dead one) another rank writes it too, unless rank 0 records a failure within
    ``QUIET_RANK_GRACE_S``."""
    if _rank() != 0 and (not any_rank or _failure_recorded(cfg.run_dir)):
        return
    record = {"status": status, "reason": reason, "step": step, "exit_code": exit_code, "time": time.time()}
    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cfg.run_dir / "last_exit.json", json.dumps(record, indent=1))
    except OSError as e:  # never mask the run's own error
        print(f"could not write {cfg.run_dir / 'last_exit.json'}: {e}")
