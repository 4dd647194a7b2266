"""TensorBoard after a resume from an older checkpoint: what the killed attempt wrote past the resumed step
is hidden (SummaryWriter's ``purge_step``), so no step shows twice. Read back with tensorboard's own
EventAccumulator. The logger alone, then a real in-process run resumed from an older checkpoint."""

from __future__ import annotations

import json

import pytest
from harness.multiproc import in_process_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from goat_dist.trainer.callbacks import TensorBoardLogger
from goat_dist.trainer.state import RunState


def scalars(log_dir, tag: str = "loss/train") -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def attempt(log_dir, start: int, last: int, loss: float, end: bool = True) -> None:
    """One attempt of a run that starts at step ``start`` and logs every step to ``last``."""
    logger, state = TensorBoardLogger(log_dir, config_text="a: 1\n"), RunState()
    state.step = start
    logger.on_train_start(state, {})
    for step in range(start + 1, last + 1):
        state.step = step
        logger.on_log(state, {"loss": loss + step})
    if end:
        logger.on_train_end(state)


def test_a_resume_hides_the_killed_attempts_later_steps(tmp_path):
    log_dir = tmp_path / "tensorboard"
    attempt(log_dir, 0, 10, loss=100.0, end=False)  # killed after step 10; its checkpoint is step 4
    attempt(log_dir, 4, 7, loss=200.0)
    assert scalars(log_dir) == [(s, 100.0 + s) for s in range(1, 5)] + [(s, 200.0 + s) for s in range(5, 8)]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # the earlier file is kept, only hidden


def test_a_resumed_in_process_run_logs_each_step_once(world1, builtin_cache, tmp_path):
    from goat_dist.trainer import Trainer

    def run(*overrides: str):
        cfg = in_process_config(builtin_cache, tmp_path, "log.tensorboard=true", "log.interval=1", *overrides)
        Trainer(cfg).fit()

    run("train.max_steps=4", "checkpoint.interval=2", "checkpoint.keep_last=0")
    run("train.max_steps=3", f"train.resume={tmp_path / 'checkpoints' / 'step_00000002'}")
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in logged if "loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 3]  # metrics.jsonl keeps both attempts
    shown = scalars(tmp_path / "tensorboard")
    assert [s for s, _ in shown] == [1, 2, 3]
    assert shown[-1][1] == pytest.approx(losses[-1][1])  # step 3 is the resumed attempt's
