"""Helpers of the tests of usage errors on the command line (``goat-dist train`` with the tiny model, the
error expected): the run, and its one clean message."""

from __future__ import annotations

import sys

from harness.multiproc import TINY, run

PREFIX = "goat-dist train:"


def train(tmp_path, *overrides: str, nproc: int = 1, **env):
    """``goat-dist train`` with the tiny model, a run dir of its own, and the user's error expected."""
    cmd = [sys.executable, "-m", "goat_dist", "train", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    return run([*cmd, *TINY, f"run.dir={tmp_path / 'run'}", *overrides], expect=2, timeout=120, **env)


def one_clean_message(proc, *words: str) -> str:
    """The one message of the run (asserted once, no traceback); each of ``words`` is in it."""
    out = proc.stdout + proc.stderr
    assert out.count(PREFIX) == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    message = proc.stderr[proc.stderr.index(PREFIX) :]
    for word in words:
        assert word in message, message
    return message
