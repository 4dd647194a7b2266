"""Callbacks' typed surface and their state across a resume (``trainer/callbacks/base.py``, ``api.py``).

One process, the tiny in-process model: a stateful callback's ``state_dict`` is saved in the checkpoint's
``trainer_state.json`` and given back by ``load_state_dict`` on resume, before its first event; a
checkpoint without it leaves the callback fresh; a run without stateful callbacks writes no ``callbacks``
key. The checkpoint manager's progress events reach callbacks as ``on_checkpoint_*`` events. The same two
runs show the collective timeouts switch after each process's first step, not before (a resume's first step
is its process's first: ``parallel/timeouts.py``)."""

from __future__ import annotations

import json

import pytest
import yaml
from harness.multiproc import in_process_config

from goat_dist.trainer.callbacks import Callback, DataPosition, TrainerAPI

STEP2 = "checkpoints/step_00000002"


class Steps(Callback):
    """The steps it saw and where the data stream was at each; runs before the checkpoint of its step
    (``order`` < ``Checkpointing``'s 40), so a step's save holds that step too."""

    order = 5
    state_key = "steps"

    def __init__(self):
        self.seen: list[int] = []
        self.samples: list[int] = []
        self.loaded: dict | None = None
        self.first_event_seen: list | None = None

    def pre_step(self, state):
        if self.first_event_seen is None:
            self.first_event_seen = list(self.seen)  # what it held at its first event

    def post_step(self, state, control):
        api = self.trainer
        assert isinstance(api, TrainerAPI) and isinstance(api.data, DataPosition)
        assert api.step == state.step and api.data.consumed_samples == state.consumed_samples
        self.seen.append(state.step)
        self.samples.append(api.data.consumed_samples)

    def state_dict(self):
        return {"seen": list(self.seen), "samples": list(self.samples)}

    def load_state_dict(self, state):
        self.loaded = state
        self.seen, self.samples = list(state["seen"]), list(state["samples"])


class Progress(Callback):
    """A save's progress as callback events (the one event bus)."""

    def __init__(self):
        self.events: list = []

    def on_checkpoint_shards_written(self, state, step_dir, step):
        self.events.append(("shards_written", step))

    def on_checkpoint_published(self, state, step_dir, step):
        self.events.append(("published", step))


class TimeoutsSeen(Callback):
    """The collective timeout every process group holds (minutes) and the hang watchdog's threshold, before
    and after each step."""

    def __init__(self):
        self.seen: list[tuple] = []
        self.signals = None  # the trainer's StopSignals, set by the test

    def _record(self, when, step):
        from goat_dist.parallel.timeouts import group_timeout, process_groups
        from goat_dist.trainer.signals import HANG_FRACTION

        groups = {group_timeout(g).total_seconds() / 60 for g in process_groups()}
        self.seen.append((when, step, groups, round(self.signals.hang_after_s / HANG_FRACTION / 60, 6)))

    def pre_step(self, state):
        self._record("pre", state.step + 1)

    def pre_optim_step(self, state, control):  # after the step's control collective, before the update
        self._record("optim", state.step + 1)

    def post_step(self, state, control):
        self._record("post", state.step)


def _trainer(cache, run_dir, *overrides, callbacks=()):
    from goat_dist.trainer import Trainer

    trainer = Trainer(in_process_config(cache, run_dir, *overrides), callbacks=[])
    for cb in callbacks:
        trainer.add_callback(cb)
    return trainer


def test_a_stateful_callbacks_state_survives_a_resume(world1, builtin_cache, tmp_path, monkeypatch):
    from goat_dist import distributed

    init = distributed.init
    asked = []  # the timeout the process groups are started with
    monkeypatch.setattr(
        distributed, "init", lambda *a, **kw: asked.append(kw["timeout_minutes"]) or init(*a, **kw)
    )
    first, progress, timeouts = Steps(), Progress(), TimeoutsSeen()
    trainer = _trainer(builtin_cache, tmp_path, "train.max_steps=2", callbacks=[first, progress, timeouts])
    timeouts.signals = trainer.signals
    trainer.fit()
    assert first.seen == [1, 2] and progress.events == [("shards_written", 2), ("published", 2)]
    startup, steady = {30.0}, {10.0}  # parallel.startup_timeout_minutes, parallel.timeout_minutes
    assert asked == [30.0] and timeouts.seen == [
        ("pre", 1, startup, 30.0),
        ("optim", 1, startup, 30.0),
        ("post", 1, steady, 10.0),
        ("pre", 2, steady, 10.0),
        ("optim", 2, steady, 10.0),
        ("post", 2, steady, 10.0),
    ]
    saved = json.loads((tmp_path / STEP2 / "trainer_state.json").read_text())
    assert saved["callbacks"] == {"steps": first.state_dict()}

    again, timeouts = Steps(), TimeoutsSeen()
    resumed = _trainer(builtin_cache, tmp_path, "train.max_steps=4", callbacks=[again, timeouts])
    timeouts.signals = resumed.signals
    assert resumed.state.step == 2
    assert again.loaded == first.state_dict() and again.state_dict() == first.state_dict()
    resumed.fit()
    assert timeouts.seen[:4] == [
        ("pre", 3, startup, 30.0),  # this process's first step
        ("optim", 3, startup, 30.0),
        ("post", 3, steady, 10.0),
        ("pre", 4, steady, 10.0),
    ]
    assert again.first_event_seen == [1, 2]  # restored before its first event
    assert again.seen == [1, 2, 3, 4] and again.samples == [4, 8, 12, 16]
    # what the resumed run saved as its config is the resolved config it ran with
    saved_config = yaml.safe_load((tmp_path / "checkpoints/step_00000004/config.yaml").read_text())
    assert saved_config == resumed.cfg.to_dict() and resumed.cfg.train.precision == "fp32"


def test_a_checkpoint_without_callback_state_leaves_callbacks_fresh(world1, builtin_cache, tmp_path):
    """A run without stateful callbacks writes no ``callbacks`` key (checkpoints as before); a callback
    resumed from such a checkpoint starts fresh."""
    _trainer(builtin_cache, tmp_path, "train.max_steps=2").fit()
    assert "callbacks" not in json.loads((tmp_path / STEP2 / "trainer_state.json").read_text())
    fresh = Steps()
    _trainer(builtin_cache, tmp_path, "train.max_steps=3", callbacks=[fresh]).fit()
    assert fresh.loaded is None and fresh.seen == [3]


def test_callback_state_must_be_json(world1, builtin_cache, tmp_path):
    class Opaque(Callback):
        def state_dict(self):
            return {"value": object()}

    trainer = _trainer(builtin_cache, tmp_path, "train.max_steps=1", callbacks=[Opaque()])
    with pytest.raises(TypeError, match="callback Opaque: state_dict"):
        trainer.callback_states()
