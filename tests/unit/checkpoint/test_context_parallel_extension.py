"""Context extension (``train.init_from``): a second stage at a longer ``model.seq_len`` starts a new run
from the first stage's checkpoint, keeps GOAT's L_train (``model.goat.train_len``) and trains. One process,
in-process Trainers."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from harness.multiproc import in_process_config, per_step

from goat_dist.checkpoint import CheckpointError, universal
from goat_dist.config import ConfigError, load_config
from goat_dist.trainer import Trainer

STAGE1_LEN, STAGE2_LEN = 32, 64


def saved_config(step_dir) -> dict:
    return yaml.safe_load((step_dir / "config.yaml").read_text())


@pytest.fixture(scope="module")
def stage1(world1, builtin_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stage1")
    cfg = in_process_config(
        builtin_cache,
        run_dir,
        f"model.seq_len={STAGE1_LEN}",
        "train.max_steps=6",
        "train.warmup_steps=1",
        "train.lr=1e-2",  # learns in 6 steps: stage 2's first loss is clearly not a fresh model's
        "log.interval=1",
    )
    Trainer(cfg).fit()
    step_dir = run_dir / "checkpoints" / "step_00000006"
    assert saved_config(step_dir)["model"]["goat"]["train_len"] == STAGE1_LEN  # resolved and saved
    return step_dir


def prior_train_lens(trainer) -> set[int]:
    return {block.attn.prior.training_seq_len for block in trainer.model.blocks}


@pytest.mark.parametrize("init_optimizer", [False, True])
def test_extension_stage_keeps_train_len_and_trains(stage1, builtin_cache, tmp_path, init_optimizer):
    run_dir = tmp_path / "stage2"
    cfg = in_process_config(
        builtin_cache,
        run_dir,
        f"model.seq_len={STAGE2_LEN}",
        "train.max_steps=4",
        "train.lr=1e-3",
        "train.warmup_steps=2",
        f"train.init_from={stage1.parent.parent}",  # a run dir: its latest checkpoint
        f"train.init_optimizer={str(init_optimizer).lower()}",
        "log.interval=1",
    )
    trainer = Trainer(cfg)
    assert trainer.state.step == 0 and trainer.init_source == stage1
    assert prior_train_lens(trainer) == {STAGE1_LEN}
    # the weights are stage 1's fp32 masters; Adam's moments only with init_optimizer
    saved, _ = universal.read_full(stage1, ("", "exp_avg"))
    state = trainer.engine.deepspeed.optimizer.state
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), saved[name][""]), name
        moment = state[p]["exp_avg"] if p in state and "exp_avg" in state[p] else torch.zeros_like(p)
        expected = saved[name]["exp_avg"] if init_optimizer else torch.zeros_like(p)
        assert torch.equal(moment, expected), name
    assert trainer.engine.lr == pytest.approx(1e-3 / 2)  # its own schedule, from step 0
    trainer.fit()
    losses = [loss for loss, _ in per_step(run_dir).values()]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    first_stage = [loss for loss, _ in per_step(stage1.parent.parent).values()]
    assert losses[0] < first_stage[0] - 0.05, (losses, first_stage)  # not a fresh model's loss
    step_dir = run_dir / "checkpoints" / "step_00000004"
    assert saved_config(step_dir)["model"]["goat"]["train_len"] == STAGE1_LEN
    assert saved_config(step_dir)["model"]["seq_len"] == STAGE2_LEN

    # a preempted stage 2 resumes itself (not stage 1 again) and keeps the same train_len
    resumed = Trainer(
        in_process_config(
            builtin_cache,
            run_dir,
            f"model.seq_len={STAGE2_LEN}",
            "train.max_steps=5",
            f"train.init_from={stage1}",
        )
    )
    assert resumed.state.step == 4 and resumed.init_source is None
    assert prior_train_lens(resumed) == {STAGE1_LEN}


def test_fresh_run_train_len_is_its_seq_len(world1, builtin_cache, tmp_path):
    trainer = Trainer(in_process_config(builtin_cache, tmp_path, "model.seq_len=48", "train.max_steps=1"))
    assert prior_train_lens(trainer) == {48}
    assert trainer.cfg.model.goat.train_len == 48


def test_init_from_another_model_is_refused(stage1, builtin_cache, tmp_path):
    cfg = in_process_config(builtin_cache, tmp_path, "model.hidden_size=128", f"train.init_from={stage1}")
    with pytest.raises(CheckpointError, match=r"model\.hidden_size 64 -> 128"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match="model.goat.train_len must be >= 1"):
        load_config(None, ["model.goat.train_len=0"])


def test_a_rank_that_cannot_see_the_init_checkpoint_is_told_which_key_named_it(world1, tmp_path):
    """The visibility check is shared with resume; its error names the key the user set."""
    from goat_dist.checkpoint.errors import CheckpointError
    from goat_dist.checkpoint.resume import agree_on_checkpoint

    missing = tmp_path / "elsewhere" / "step_00000004"
    with pytest.raises(CheckpointError, match=r"which train\.init_from=.*step_00000004 names"):
        agree_on_checkpoint(str(missing), lambda: None, key="train.init_from")


def test_an_explicit_train_len_that_differs_from_the_checkpoints_is_printed(tmp_path):
    from goat_dist.checkpoint.extension import resolve_train_len

    (tmp_path / "config.yaml").write_text("model:\n  seq_len: 256\n  goat:\n    train_len: 64\n")
    kept = load_config(None, ["model.seq_len=512"])
    assert resolve_train_len(kept, tmp_path, log=pytest.fail) == 64  # unset: the checkpoint's, silently
    lines = []
    changed = load_config(None, ["model.seq_len=512", "model.goat.train_len=512"])
    assert resolve_train_len(changed, tmp_path, log=lines.append) == 512
    assert len(lines) == 1 and "model.goat.train_len=512" in lines[0] and "replaces 64" in lines[0]
