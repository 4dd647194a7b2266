"""A resume or ``train.init_from`` from a checkpoint of another model names the config keys that changed
(``model.num_layers 1 -> 2``) and the fix, not a tensor; one trained with another tokenizer says its
embeddings belong to that tokenizer instead of suggesting ``train.data_resume=restart``. In-process."""

from __future__ import annotations

import pytest
import torch
from harness.multiproc import in_process_config

from goat_dist.checkpoint import CheckpointError, CheckpointManager
from goat_dist.checkpoint.compat import model_changes
from goat_dist.checkpoint.extension import init_weights
from goat_dist.config import ModelConfig
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize
from goat_dist.shapes import resolve_key_bias_lanes
from goat_dist.trainer import Trainer
from goat_dist.trainer.entry import exit_code_for


@pytest.fixture(scope="module")
def trained(world1, builtin_cache, tmp_path_factory):
    """(cache, run dir) of a one-layer run with its step-1 checkpoint."""
    run_dir = tmp_path_factory.mktemp("mismatch") / "run"
    Trainer(in_process_config(builtin_cache, run_dir, "train.max_steps=1")).fit()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000001"
    return builtin_cache, run_dir


def refusal(cfg) -> str:
    with pytest.raises(CheckpointError) as caught:
        Trainer(cfg)
    assert exit_code_for(caught.value) == 2
    return str(caught.value)


def test_resume_into_another_model_names_the_keys_and_the_fix(trained):
    cache, run_dir = trained
    message = refusal(in_process_config(cache, run_dir, "model.num_layers=2", "train.max_steps=2"))
    assert "cannot resume from" in message and "model.num_layers 1 -> 2" in message
    assert "new run.dir" in message and "blocks." not in message
    message = refusal(in_process_config(cache, run_dir, "model.hidden_size=128", "model.num_heads=8"))
    assert "model.hidden_size 64 -> 128, model.num_heads 4 -> 8" in message


def test_a_resume_under_bf16_that_would_change_goats_lanes_is_refused(trained):
    """The fixture trained under fp32: u(j) on one lane (2R+1). Under bf16 auto builds 2R+3, another q/k
    shape: refused before the model is built, naming the key, both lane counts and the fix."""
    cache, run_dir = trained
    message = refusal(in_process_config(cache, run_dir, "train.precision=bf16", "train.max_steps=2"))
    assert "cannot resume from" in message, message
    assert "model.goat.key_bias_lanes is 1 there (9 = 2R+1" in message, message
    assert "3 here (11 = 2R+3, auto under train.precision=bf16)" in message, message
    assert "Set model.goat.key_bias_lanes=1 to continue it" in message and "blocks." not in message


def test_a_vocabulary_change_says_the_embeddings_belong_to_another_tokenizer(trained):
    cache, run_dir = trained
    message = refusal(in_process_config(cache, run_dir, "model.vocab_size=8192", "train.max_steps=2"))
    assert "another tokenizer" in message
    assert "set train.data_resume=restart" not in message


def test_init_from_another_model_names_the_keys_and_the_fix(trained, tmp_path):
    cache, run_dir = trained
    cfg = in_process_config(cache, tmp_path, "model.num_layers=2", f"train.init_from={run_dir}")
    message = refusal(cfg)
    assert "train.init_from=" in message and "model.num_layers 1 -> 2" in message
    assert "leave train.init_from out" in message and "blocks." not in message


def _engine(cache, run_dir, *overrides):
    cfg = in_process_config(cache, run_dir, "train.max_steps=2", *overrides)
    resolve_key_bias_lanes(cfg.model, "fp32")  # GOAT's lanes as the trainer resolved them on this CPU
    torch.manual_seed(0)
    return parallelize(GPT(cfg.model), cfg, grad_accum=1)


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _unchanged(engine, before: dict) -> bool:
    return all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


def test_another_shape_is_refused_before_any_weight_is_copied(trained):
    """The first layer fits a two-layer model; it is not copied when the second has nothing to load."""
    cache, run_dir = trained
    step_dir = run_dir / "checkpoints" / "step_00000001"
    engine = _engine(cache, run_dir, "model.num_layers=2")
    before = _weights(engine)
    with pytest.raises(CheckpointError, match=r"model\.num_layers 1 -> 2"):
        init_weights(engine, engine.module, step_dir, optimizer=False)
    with pytest.raises(CheckpointError, match=r"model\.num_layers 1 -> 2"):
        CheckpointManager(run_dir).load(engine, step_dir, {"world": 1, "tp": 1, "dp": 1, "zero_stage": 0})
    assert _unchanged(engine, before)


def test_another_tokenizer_is_refused_without_suggesting_a_data_restart(trained):
    """The run's data contract names another tokenizer than the checkpoint's (the same vocabulary size):
    both a resume and an init_from refuse, saying why, before loading anything."""
    cache, run_dir = trained
    step_dir = run_dir / "checkpoints" / "step_00000001"
    engine = _engine(cache, run_dir)
    before = _weights(engine)
    other = {"tokenizer_sha256": ["f" * 64]}
    layout = {"world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    for load, fix in (
        (lambda: CheckpointManager(run_dir).load(engine, step_dir, layout, contract=other), "new run.dir"),
        (
            lambda: init_weights(engine, engine.module, step_dir, optimizer=False, contract=other),
            "leave train.init_from out",
        ),
    ):
        with pytest.raises(CheckpointError) as caught:
            load()
        message = str(caught.value)
        assert "embeddings belong to another tokenizer" in message and "ffffffffffff" in message
        assert "set train.data_resume=restart" not in message and fix in message, message
    assert _unchanged(engine, before)


def test_the_same_tokenizer_loads(trained):
    cache, run_dir = trained
    step_dir = run_dir / "checkpoints" / "step_00000001"
    engine = _engine(cache, run_dir)
    import json

    contract = json.loads((step_dir / "trainer_state.json").read_text())["data_contract"]
    info = init_weights(engine, engine.module, step_dir, optimizer=False, contract=contract)
    assert info["step"] == 1


def test_model_changes_lists_shape_keys_only():
    saved = {"num_layers": 2, "dropout": 0.0, "attention_backend": "sdpa", "goat": {"pos_rank": 4}}
    now = ModelConfig(num_layers=3, dropout=0.1, attention_backend="eager")
    now.goat.pos_rank = 2
    assert model_changes(saved, now) == ["model.num_layers 2 -> 3", "model.goat.pos_rank 4 -> 2"]
    learned = ModelConfig(position="learned", seq_len=64)
    assert "model.seq_len 256 -> 64" in model_changes({"position": "learned"}, learned)
    assert model_changes({"seq_len": 256}, ModelConfig(seq_len=64)) == []  # no table: no shape
