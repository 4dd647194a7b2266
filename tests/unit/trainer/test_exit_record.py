"""``trainer.entry.run``'s last moves after a run that did not fail: rank 0's ``last_exit.json`` is on disk
before the final barrier lets any rank go (``srun --kill-on-bad-exit=1`` ends a step as soon as one task
exits non-zero), and after a checkpointed stop only rank 0 exits 75. The trainer and the process groups
are stand-ins: what is checked is the order of the writes, the barrier and the exits."""

from __future__ import annotations

import json

import pytest

from goat_dist.trainer import entry
from goat_dist.trainer.signals import EXIT_CHECKPOINTED
from goat_dist.trainer.state import RunState


@pytest.fixture
def world(tmp_path, monkeypatch):
    """``entry.run`` with a trainer that stops at step 7 (``stop`` in its state) and a log of events."""
    from goat_dist.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    events: list[tuple] = []
    stop = {"reason": "SIGUSR1"}

    class Trainer:
        def __init__(self, cfg):
            self.state = RunState(step=7)

        def fit(self):
            self.state.stop_requested = stop["reason"]
            return self.state

    record = cfg.run_dir / "last_exit.json"
    write = entry.atomic_write_text

    def atomic_write_text(path, text):
        write(path, text)
        events.append(("written", path.name))

    def teardown(barrier=True):
        events.append(("barrier" if barrier else "teardown", record.exists()))

    monkeypatch.setattr(entry, "Trainer", Trainer)
    monkeypatch.setattr(entry, "check_data_sources", lambda cfg: None)
    monkeypatch.setattr(entry, "atomic_write_text", atomic_write_text)
    monkeypatch.setattr(entry.distributed, "teardown", teardown)
    return cfg, events, stop, record


@pytest.mark.parametrize("reason", ["SIGUSR1", None])
def test_rank0_record_is_on_disk_before_the_final_barrier(world, monkeypatch, reason):
    cfg, events, stop, record = world
    stop["reason"] = reason
    monkeypatch.setenv("RANK", "0")
    state = entry.run(cfg)
    assert events == [("written", "last_exit.json"), ("barrier", True)]  # the barrier found it there
    written = json.loads(record.read_text())
    if reason:
        assert (written["status"], written["reason"], written["step"]) == ("checkpointed", reason, 7)
        assert written["exit_code"] == EXIT_CHECKPOINTED == entry.process_exit_code(state)
    else:
        assert (written["status"], written["exit_code"]) == ("finished", 0)
        assert entry.process_exit_code(state) == 0


def test_other_ranks_exit_0_after_a_checkpointed_stop(world, monkeypatch):
    """Their 75 would be a bad exit to srun: it would kill rank 0; the record carries 75 for them."""
    cfg, events, stop, record = world
    monkeypatch.setenv("RANK", "1")
    state = entry.run(cfg)
    assert state.stop_requested and entry.process_exit_code(state) == 0  # what the command line exits with
    assert events == [("barrier", False)]  # rank 1 writes nothing, waits for rank 0's record, then leaves
    monkeypatch.setenv("RANK", "0")
    assert entry.process_exit_code(state) == EXIT_CHECKPOINTED
