"""Checkpoint -> export -> load: the loaded model's logits equal the training model's (fp32, 1e-5)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config

from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.export import export, inspect
from goat_dist.config import load_config
from goat_dist.inference import load_exported
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize


@pytest.mark.parametrize("lanes", ["auto", 1], ids=["auto-lanes", "one-key-lane"])
def test_export_load_logits_match_training_model(world1, tmp_path, lanes):
    """Also with one u(j) lane (the fp32 layout): the saved config's lane count rebuilds the same model."""
    cfg = one_layer_config("model.num_layers=2", f"model.goat.key_bias_lanes={lanes}")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=1)
    tokens = torch.randint(0, 300, (2, 33))
    positions = torch.arange(32).expand(2, -1)
    for _ in range(3):  # move the weights away from their initial values
        engine.backward(engine(tokens[:, :-1], positions, tokens[:, 1:]))
        engine.step()

    manager = CheckpointManager(tmp_path / "run")
    state = {"step": 3, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    manager.save(engine, state, yaml.safe_dump(cfg.to_dict()))
    info = inspect(tmp_path / "run")
    assert info["valid"] and info["step"] == 3 and info["universal"] and info["format"] == 3
    # the format read from index.json: no meta.json (every piece listed) is written any more
    assert not list((tmp_path / "run").rglob("meta.json"))

    out = export(tmp_path / "run", tmp_path / "exported")
    saved = json.loads((out / "config.json").read_text())
    assert saved["hidden_size"] == 64 and saved["goat"]["key_bias_lanes"] == lanes
    loaded, _ = load_exported(out)
    with torch.no_grad():
        expected = model.eval()(tokens[:, :-1], positions)[..., :300]
        got = loaded(tokens[:, :-1], positions)[..., :300]
    assert (got - expected).abs().max().item() <= 1e-5
    assert not torch.equal(expected, GPT(cfg.model).eval()(tokens[:, :-1], positions)[..., :300])


def test_generate_smoke(world1, builtin_cache, tmp_path):
    """Greedy generation from an exported model produces text that starts with the prompt."""
    from goat_dist.data import builtin_dataset_dir, load_tokenizer
    from goat_dist.inference import generate

    cfg = load_config(
        None,
        [
            "model.num_layers=1",
            "model.hidden_size=64",
            "model.num_heads=4",
            "model.seq_len=32",
            "model.attention_backend=sdpa",
        ],
    )
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    tokenizer = load_tokenizer(builtin_dataset_dir(builtin_cache, 4096, 1_000_000) / "tokenizer.json")
    text = generate(model, tokenizer, "def read(path):", max_new_tokens=5)
    assert text.startswith("def read(path):") and len(tokenizer.encode(text).ids) > len(
        tokenizer.encode("def read(path):").ids
    )


def test_bf16_export_is_the_fp32_masters_with_the_prior_kept_fp32(world1, tmp_path):
    """Under bf16 the checkpoint's universal state, hence the export, holds DeepSpeed's fp32 master weights
    (not the bf16 forward copy); a bf16 export rounds every tensor but GOAT's prior, which stays fp32."""
    from safetensors.torch import load_file

    from goat_dist.engine.masters import layout_of

    cfg = one_layer_config("train.precision=bf16")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=1)
    tokens = torch.randint(0, 300, (2, 33))
    positions = torch.arange(32).expand(2, -1)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(tokens[:, :-1], positions, tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    state = {"step": 3, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(tmp_path / "run").save(engine, state, yaml.safe_dump(cfg.to_dict()))
    masters = {name: layout_of(engine).full(p)[""] for name, p in model.named_parameters()}

    fp32 = load_file(export(tmp_path / "run", tmp_path / "fp32") / "model.safetensors")
    bf16 = load_file(export(tmp_path / "run", tmp_path / "bf16", dtype="bf16") / "model.safetensors")
    priors = [name for name in masters if ".prior." in name]
    assert priors
    not_bf16_representable = 0
    for name, master in masters.items():
        assert torch.equal(fp32[name], master), name
        if name in priors:
            assert bf16[name].dtype == torch.float32 and torch.equal(bf16[name], master), name
        else:
            assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], master.bfloat16()), name
        not_bf16_representable += int(not torch.equal(master, master.bfloat16().float()))
    assert not_bf16_representable >= len(masters) // 2  # fp32 masters, not the bf16 forward weights


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["022", "002"])
def test_export_modes_follow_the_umask(world1, tmp_path, mask):
    """The exported directory and files get the modes a plain mkdir / open would (not mkdtemp's 0700)."""
    cfg = one_layer_config()
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    state = {"step": 0, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(tmp_path / "run").save(engine, state, yaml.safe_dump(cfg.to_dict()))
    old = os.umask(mask)
    try:
        out = export(tmp_path / "run", tmp_path / "exported")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~mask, name
