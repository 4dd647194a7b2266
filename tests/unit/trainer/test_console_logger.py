"""The console's words: after a stop, the last line names the checkpoint and the command that continues;
an MFU the measured CPU peak cannot explain is said once to be unknown, then left out of the lines."""

from __future__ import annotations

import io
from types import SimpleNamespace

from goat_dist.trainer.callbacks.loggers import ConsoleLogger
from goat_dist.trainer.state import RunState

LINE = {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0}


def logger(resume: str = "auto") -> tuple[ConsoleLogger, io.StringIO]:
    out = io.StringIO()
    console = ConsoleLogger(100, stream=out)
    console.attach(SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(resume=resume))))
    return console, out


def test_the_last_line_after_a_stop_names_the_checkpoint_and_the_command():
    console, out = logger()
    state = RunState(step=37, consumed_tokens=1000, stop_requested="SIGINT")
    console.on_checkpoint(state, {"path": "runs/x/checkpoints/step_00000037", "save_s": 0.1})
    console.on_train_end(state)
    assert out.getvalue().splitlines()[-1] == (
        "stopped at step 37 (SIGINT): checkpoint runs/x/checkpoints/step_00000037; "
        "run the same command to continue"
    )


def test_a_run_that_does_not_resume_by_itself_is_told_how():
    console, out = logger(resume="never")
    state = RunState(step=5, stop_requested="deadline")
    console.on_checkpoint(state, {"path": "r/checkpoints/step_00000005", "save_s": 0.1})
    console.on_train_end(state)
    assert (
        out.getvalue()
        .splitlines()[-1]
        .endswith(
            "(deadline): checkpoint r/checkpoints/step_00000005; run the same command with train.resume=auto "
            "to continue"
        )
    )


def test_a_pinned_run_continues_with_the_same_command():
    """A pin continues from the run's own newest checkpoint that began at it (checkpoint/lineage.py)."""
    console, out = logger(resume="runs/old/checkpoints/step_00000140")
    state = RunState(step=160, stop_requested="SIGTERM")
    console.on_checkpoint(state, {"path": "runs/new/checkpoints/step_00000160", "save_s": 0.1})
    console.on_train_end(state)
    assert out.getvalue().splitlines()[-1].endswith("step_00000160; run the same command to continue")


def test_a_finished_run_still_says_done():
    console, out = logger()
    console.on_train_end(RunState(step=30, consumed_tokens=61440, elapsed_s=48))
    assert out.getvalue().splitlines()[-1] == "done: 30 steps, 61,440 tokens, 00:48"


def test_mfu_over_the_measured_peak_is_said_once_and_then_left_out():
    console, out = logger()
    state = RunState(step=10)
    console.on_log(state, {**LINE, "mfu": 0.25})
    console.on_log(state, {**LINE, "mfu": 1.0, "mfu_raw": 1.3, "mfu_unreliable": True})
    console.on_log(state, {**LINE, "mfu": 0.9})
    lines = out.getvalue().splitlines()
    assert "(MFU 25.0%)" in lines[0]
    assert lines[1].startswith("MFU unknown") and "log.peak_tflops" in lines[1]
    assert all("MFU" not in line for line in lines[2:]) and len(lines) == 4
    assert ">100%" not in out.getvalue()
