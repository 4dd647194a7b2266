"""What the collective timeouts look like from the trainer's side: the hang watchdog's threshold can be
switched (``StopSignals.set_hang_after``), and a collective that timed out is recorded naming the timeout
that applied: ``parallel.startup_timeout_minutes`` before this rank's first step ended,
``parallel.timeout_minutes`` after."""

from __future__ import annotations

import time
import types

from goat_dist.config import load_config
from goat_dist.parallel.timeouts import Timeouts
from goat_dist.trainer import entry
from goat_dist.trainer.signals import StopSignals

TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv")


def test_the_watchdogs_threshold_switches():
    signals = StopSignals(hang_after_s=1620.0)
    assert signals.hang_after_s == signals.stacks.hang_after_s == 1620.0
    signals.set_hang_after(540.0)
    assert signals.hang_after_s == signals.stacks.hang_after_s == 540.0


def test_a_timeout_before_the_first_step_ended_names_the_startup_timeout():
    cfg = load_config(None, ["parallel.startup_timeout_minutes=30", "parallel.timeout_minutes=10"])
    for trainer in (None, types.SimpleNamespace(timeouts=Timeouts.from_config(cfg.parallel))):
        reason = entry.collective_failure(TIMED_OUT, cfg, trainer)
        assert reason.startswith("a collective timed out (parallel.startup_timeout_minutes=30, the start-up")
        assert "first step had not ended" in reason and "parallel.timeout_minutes" not in reason
        assert "1800000ms" in reason


def test_a_timeout_after_the_first_step_names_the_steady_timeout():
    cfg = load_config(None, ["parallel.timeout_minutes=10"])
    timeouts = Timeouts.from_config(cfg.parallel)
    timeouts.steady = True
    reason = entry.collective_failure(TIMED_OUT, cfg, types.SimpleNamespace(timeouts=timeouts))
    assert reason.startswith("a collective timed out (parallel.timeout_minutes=10): another rank")
    assert "startup" not in reason


def test_an_error_that_is_no_collective_failure_stays_none():
    cfg = load_config(None, [])
    assert entry.collective_failure(ValueError("bad value"), cfg, None) is None


def test_a_shorter_threshold_wakes_a_watch_sleeping_towards_the_longer_one(tmp_path):
    """After step 1 the watchdog's threshold shrinks (start-up -> steady timeout): a rank that then waits in
    a collective prints its stacks before the steady timeout, not at the start-up one."""
    out = (tmp_path / "stacks.txt").open("w")
    signals = StopSignals(hang_after_s=600.0)
    signals.stacks.fd = out.fileno()
    with signals:
        signals.step_started()  # the watch thread sleeps towards 600 s from now
        time.sleep(0.1)
        signals.set_hang_after(0.2)
        deadline = time.monotonic() + 5
        while signals.stacks.dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    out.close()
    assert signals.stacks.dumps == 1
    assert "(hang watchdog after 0.2 s)" in (tmp_path / "stacks.txt").read_text()
