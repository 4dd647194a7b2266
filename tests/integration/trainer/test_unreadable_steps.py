"""``data.on_error=skip`` must not train on nothing. A step whose global batch has no label with loss (all
IGNORE_INDEX: the masked rest of a corrupt shard) drops its update like a non-finite step (no optimizer
and no LR-schedule step), is counted (``unreadable_skipped``) and warned about, and more than
``train.max_nonfinite_in_row`` such steps in a row stop the run, also across a resume. In-process runs on
one rank (the world1 fixture), a few seconds each; one DP=2 run (slow): the global batch decides."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.multiproc import goat_train_command, in_process_config, records, run

from data_tools.shard_format import write_manifest
from data_tools.writer import ShardWriter
from goat_dist.data import IGNORE_INDEX

STEPS = 18  # two epochs of the data set below (11 steps each)
OVERRIDES = [
    "data.on_error=skip",
    "data.shuffle_buffer=0",  # stream order: the corrupt shard's windows come as a run of steps
    "train.warmup_steps=50",  # the LR changes at every applied step: a scheduler step shows
    "log.interval=1",
    f"train.max_steps={STEPS}",
]


@pytest.fixture(scope="module")
def corrupt_data(tmp_path_factory) -> tuple[Path, str]:
    """Two train shards of 60-token documents, the second cut 8 bytes after its first tar header: every
    document of it is unreadable, whether a reader masks the shard's rest from its first bad document on
    or only the documents past the truncation point."""
    root = tmp_path_factory.mktemp("corrupt")
    rng = np.random.default_rng(0)
    splits = {}
    for split, count, shard_mb in (("train", 24, 0.0122), ("val", 4, 1.0)):
        with ShardWriter(root, split, shard_mb, vocab_size=4096) as w:
            for d in range(count):
                w.write(f"doc-{d:05d}", rng.integers(1, 4096, 60))
        splits[split] = w.shards
    assert len(splits["train"]) == 2, splits["train"]
    manifest = {"vocab_size": 4096, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    write_manifest(root, manifest)
    bad = splits["train"][1]["name"]
    with open(root / bad, "r+b") as f:
        f.truncate(512 + 8)
    return root, bad


def config(data: Path, run_dir: Path, *overrides: str):
    return in_process_config(run_dir / "cache", run_dir, f"data.source={data}", *OVERRIDES, *overrides)


def labels_with_loss(cfg, layout, sources) -> list[list[int]]:
    """Per step (from 1), each data-parallel rank's count of labels with loss, read from fresh copies of
    the training stream: the oracle, independent of the trainer's counting."""
    from goat_dist.data.batches import train_loader

    t = cfg.train
    accum = t.global_batch_size // (t.micro_batch_size * layout.dp)
    ranks = [dataclasses.replace(layout, dp_rank=r) for r in range(layout.dp)]
    its = [iter(train_loader(cfg, rank, sources)) for rank in ranks]
    return [
        [sum(int((next(it)["labels"] != IGNORE_INDEX).sum()) for _ in range(accum)) for it in its]
        for _ in range(STEPS)
    ]


def unreadable_steps(trainer) -> list[int]:
    """Steps (from 1) whose whole global batch has no label with loss."""
    counts = labels_with_loss(trainer.cfg, trainer.layout, trainer.sources)
    return [step for step, per_rank in enumerate(counts, 1) if not sum(per_rank)]


def first_run_longer_than(steps: list[int], limit: int) -> int:
    """The step that makes ``limit + 1`` unreadable steps in a row."""
    return next(s for s in steps if all(s - k in steps for k in range(limit + 1)))


class Weights:
    """Callback: the full weights after every logged step (and at the start)."""

    def __init__(self):
        self.engine, self.after = None, {}

    def snapshot(self, step: int) -> None:
        self.after[step] = [p.detach().clone() for p in self.engine.module.parameters()]

    def on_train_start(self, state, info):
        self.snapshot(state.step)

    def on_log(self, state, metrics):
        self.snapshot(state.step)

    def __getattr__(self, name):  # the other callback events: nothing to record
        if name.startswith("on_"):
            return lambda *args: None
        raise AttributeError(name)


def trainer_with(cfg):
    from goat_dist.trainer import Trainer
    from goat_dist.trainer.callbacks import JsonlLogger

    weights = Weights()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, callbacks=[JsonlLogger(cfg.run_dir / "metrics.jsonl"), weights])
    weights.engine = trainer.engine
    return trainer, weights


def test_steps_without_a_readable_label_take_no_optimizer_step(world1, corrupt_data, tmp_path, capsys):
    root, bad = corrupt_data
    run_dir = tmp_path / "run"
    trainer, weights = trainer_with(config(root, run_dir, "train.max_nonfinite_in_row=20"))
    empty = unreadable_steps(trainer)
    assert len(empty) >= 4 and any(s - 1 in empty and s not in empty for s in range(2, STEPS + 1)), empty
    state = trainer.fit()

    logged = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        unchanged = all(torch.equal(a, b) for a, b in zip(weights.after[step - 1], weights.after[step]))
        assert unchanged == (step in empty), f"step {step}: update {'applied' if unchanged else 'dropped'}?"
        if step < STEPS:  # the scheduler advanced exactly at the applied steps
            same_lr = logged[step + 1]["lr"] == logged[step]["lr"]
            assert same_lr == (step in empty), f"step {step}: lr {logged[step]['lr']} -> {logged[step + 1]}"
        assert math.isnan(logged[step]["loss"]) == (step in empty), logged[step]
        assert logged[step]["unreadable_skipped"] == sum(s <= step for s in empty)
        assert logged[step]["nonfinite_skipped"] == 0
    assert state.unreadable_skipped == len(empty) and state.nonfinite_skipped == 0
    assert state.unreadable_in_row == 0 and state.data_skipped > 0
    out = capsys.readouterr().out.splitlines()
    for step in empty:
        line = next(x for x in out if x.startswith(f"step {step}: warning: unreadable data"))
        assert "no label of the global batch carries loss" in line and f"shard {bad}" in line, line
        assert "update dropped" in line
    steps = [x for x in out if x.startswith("step ")]  # "step N: ..." lines (not "first step done: ...")
    assert not any("warning: unreadable data" in x for x in steps if int(x.split()[1][:-1]) not in empty)


def test_too_many_unreadable_steps_in_a_row_raise(world1, corrupt_data, tmp_path):
    from goat_dist.trainer.entry import exit_code_for
    from goat_dist.trainer.unreadable import UnreadableDataError

    root, bad = corrupt_data
    trainer, _ = trainer_with(config(root, tmp_path / "run", "train.max_nonfinite_in_row=3"))
    empty = unreadable_steps(trainer)
    stop = first_run_longer_than(empty, 3)
    with pytest.raises(UnreadableDataError) as info:
        trainer.fit()
    message = str(info.value)
    assert message.startswith(f"step {stop}: no readable label in the global batch"), message
    assert "4 such steps in a row (limit train.max_nonfinite_in_row=3)" in message
    assert f"shard {bad}" in message and "data.on_error=skip" in message
    assert trainer.state.step == stop - 1 and trainer.state.unreadable_skipped == sum(s < stop for s in empty)
    assert exit_code_for(info.value) == 2  # the user's to fix, like a non-finite run


def test_the_run_of_unreadable_steps_counts_across_a_resume(world1, corrupt_data, tmp_path):
    """Stopped (and checkpointed) in the middle of a run of unreadable steps, the resumed run raises at the
    same step as an uninterrupted one: the count in a row is part of the run state."""
    from goat_dist.trainer.unreadable import UnreadableDataError

    root, _ = corrupt_data
    run_dir = tmp_path / "run"
    probe, _ = trainer_with(config(root, tmp_path / "probe", "train.max_nonfinite_in_row=3"))
    stop = first_run_longer_than(unreadable_steps(probe), 3)
    # a run that ends two steps into the run of unreadable steps (the config is read-only once resolved)
    first, _ = trainer_with(
        config(root, run_dir, "train.max_nonfinite_in_row=3", f"train.max_steps={stop - 2}")
    )
    first.fit()
    assert (run_dir / "checkpoints" / "latest").is_file() and first.state.unreadable_in_row == 2

    resumed, _ = trainer_with(config(root, run_dir, "train.max_nonfinite_in_row=3"))
    assert resumed.resumed_from is not None and resumed.state.step == stop - 2
    assert resumed.state.unreadable_in_row == 2
    assert resumed.state.unreadable_skipped == first.state.unreadable_skipped
    with pytest.raises(UnreadableDataError, match=rf"^step {stop}: .* 4 such steps in a row"):
        resumed.fit()


@pytest.mark.slow
def test_two_data_parallel_ranks_drop_only_a_globally_empty_step(world1, corrupt_data, tmp_path):
    """DP=2 under ZeRO-2: a step is dropped only when neither rank's batch has a label with loss; a step
    where one rank's batch is all unreadable and the other's is not trains (the count of labels travels
    in the step's one collective). Weights unchanged shows in ``params_norm``, the schedule in ``lr``."""
    from goat_dist.config import load_config

    root, _ = corrupt_data
    overrides = [
        "model.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",  # 2 micro-batches per rank and step
        "parallel.zero_stage=2",
        f"data.source={root}",
        *OVERRIDES,
        "train.max_nonfinite_in_row=20",
    ]
    sources = [{"path": str(root), "weight": 1.0}]
    layout = dataclasses.replace(world1, dp=2)
    for seed in range(20):  # a stream that has both kinds of steps; which one depends on the loader
        cfg = load_config(None, [*overrides, f"train.seed={seed}"])
        counts = labels_with_loss(cfg, layout, sources)
        empty = [step for step, c in enumerate(counts, 1) if not sum(c)]
        half = [step for step, c in enumerate(counts, 1) if sum(c) and not min(c) and 1 < step < STEPS]
        if empty and half:  # each step in 2..STEPS-1 is checked below: a half step must train
            break
    else:
        pytest.fail("no seed gives a step with one rank's batch all unreadable")
    run_dir = tmp_path / "run"
    run(goat_train_command(2, [*overrides, f"train.seed={seed}", f"run.dir={run_dir}"]))
    logged = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step in range(2, STEPS):
        before, now, after = logged[step - 1], logged[step], logged[step + 1]
        dropped = step in empty
        assert (now["params_norm"] == before["params_norm"]) == dropped, (step, counts[step - 1])
        assert (after["lr"] == now["lr"]) == dropped, (step, counts[step - 1])
        assert math.isnan(now["loss"]) == dropped
        assert now["unreadable_skipped"] == sum(s <= step for s in empty)
