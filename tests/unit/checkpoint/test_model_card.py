"""The model card (``README.md``) ``goat-dist ckpt export`` writes: architecture and GOAT's settings, the
tokens trained, data and tokenizer, the results ``goat-dist eval`` left in the run directory (real ppl and
passkey reports, an lm-eval one in its schema), and how to load each format."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config

from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.export import MARKER, export
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize

TOKENS = 123_456
STEP = 7


def checkpoint(run, *overrides: str, step: int = STEP) -> None:
    cfg = one_layer_config(*overrides)
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    run_state = {"consumed_tokens": TOKENS, "consumed_samples": 482}
    state = {"step": step, "run_state": run_state, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(run).save(engine, state, yaml.safe_dump(cfg.to_dict()))


@pytest.fixture(scope="module")
def evaluated(world1, builtin_cache, tmp_path_factory):
    """A GOAT run on the builtin data (its tokenizer found) with ``goat-dist eval`` results: perplexity
    and passkey measured here, an lm-eval report as ``eval harness`` writes it, and an older step's."""
    from goat_dist.evaluation.reports import passkey_report, ppl_report, write_passkey, write_ppl
    from goat_dist.evaluation.session import Session

    run = tmp_path_factory.mktemp("card") / "goat-card"
    data = [f"data.cache_dir={builtin_cache}", "data.builtin_max_bytes=1000000", "model.vocab_size=4096"]
    checkpoint(run, "model.num_kv_heads=2", "model.goat.key_bias_lanes=1", *data)
    session = Session(str(run), None, "sdpa", "fp32")
    try:
        write_ppl(ppl_report(session, "builtin", "val", [32, 64], 256, 256), run / "eval")
        write_passkey(passkey_report(session, [32], [0.5], 2, 0, 256), run / "eval")
    finally:
        torch.set_grad_enabled(True)  # a Session turns autograd off for its process; the next tests train
    harness = {
        "task": "harness",
        "step": STEP,
        "lm_eval_version": "0.4.13",
        "limit": 8,
        "results": {
            "goat_python_choice": {
                "alias": "goat_python_choice",
                "acc,none": 0.375,
                "acc_stderr,none": 0.183,
                "acc_norm,none": 0.625,
                "acc_norm_stderr,none": 0.183,
            }
        },
    }
    (run / "eval" / "harness.json").write_text(json.dumps(harness))
    (run / "eval" / "harness.step3.json").write_text(json.dumps({**harness, "step": 3}))
    return run


def card(out) -> str:
    text = (out / "README.md").read_text()
    assert text.startswith("---\n") and "\n---\n" in text  # Hugging Face's front matter
    assert "README.md" in json.loads((out / MARKER).read_text())["files"]  # the export's own
    return text


@pytest.mark.parametrize("fmt", ["goat", "hf"])
def test_the_card_describes_the_model_its_training_and_evaluation(evaluated, tmp_path, fmt):
    out = export(evaluated, tmp_path / f"goat-card-{fmt}", fmt=fmt)
    text = card(out)
    assert "\n# goat-tiny\n" in text  # the run's name
    assert f"goat-dist ckpt export` ({'Hugging Face' if fmt == 'hf' else 'goat-dist'} format" in text
    # architecture and GOAT
    for row in (
        "| layers | 1 |",
        "| hidden size | 64 |",
        "| vocabulary | 4,096 |",
        "| training context | 32",
    ):
        assert row in text, row
    assert "4 of dim 16, 2 key/value heads (GQA)" in text and "position scheme | `goat`" in text
    assert "R = 4 (`pos_rank`)" in text and "M = 4 absolute Fourier features" in text
    assert "1 lane(s)" in text and "L_train = 32" in text
    assert "the prior takes 9 of each q/k head's 16 dims; content attention uses the other 7" in text
    params = sum(
        p.numel()
        for p in GPT(
            one_layer_config(
                "model.vocab_size=4096", "model.num_kv_heads=2", "model.goat.key_bias_lanes=1"
            ).model
        ).parameters()
    )
    assert f"| parameters | {params:,} (" in text  # vocabulary 4096 is a multiple of 128: no padding
    # training, data, tokenizer
    assert f"tokens trained: {TOKENS:,} (482 sequences)" in text and f"(step {STEP})" in text
    assert "builtin corpus" in text and "1,000,000 bytes" in text
    assert re.search(r"`tokenizer.json` \(shipped here; the one training used, sha256 [0-9a-f]{12}\)", text)
    # evaluation: the real reports' numbers, an older step's report left out
    ppl = json.loads(next((evaluated / "eval").glob("ppl_*_val.json")).read_text())
    assert len(ppl["results"]) == 2
    for r in ppl["results"]:
        row = f"| {r['length']} | {r['multiple']:.4g} | {r['loss']:.4g} | {r['ppl']:.4g} |"
        assert row in text, row
    passkey = json.loads((evaluated / "eval" / "passkey.json").read_text())
    assert "Passkey retrieval" in text and f"| 32 | {passkey['accuracy'][0][0]:.4g} |" in text
    assert "| goat_python_choice | acc | 0.375 | 0.183 |" in text
    assert "| goat_python_choice | acc_norm | 0.625 | 0.183 |" in text
    assert "3 reports" in text and "step 3" not in text and "measured at step" not in text
    # how to load
    assert f"goat-dist generate --model {out.name}" in text and "load_exported" in text
    if fmt == "hf":
        assert "library_name: transformers" in text
        assert f'AutoModelForCausalLM.from_pretrained("{out.name}", trust_remote_code=True)' in text
        assert f"lm_eval --model hf --model_args pretrained={out.name},trust_remote_code=True" in text
    else:
        assert "AutoModelForCausalLM" not in text and f"--checkpoint {out.name}" in text


def test_a_rope_card_loads_without_remote_code_and_says_it_is_not_evaluated(world1, tmp_path):
    run = tmp_path / "rope-run"
    checkpoint(run, "model.position=rope", "model.rope_base=500", step=2)
    text = card(export(run, tmp_path / "rope-hf", fmt="hf", dtype="bf16"))
    assert "position scheme | `rope`" in text and "RoPE base (theta): 500." in text
    assert "GOAT's prior" not in text and "bf16 weights" in text
    assert 'from_pretrained("rope-hf")' in text and "trust_remote_code" not in text
    assert "Not evaluated yet: no `goat-dist eval` results in `rope-run/eval/`" in text
    assert "tokenizer: none found" in text


def test_results_of_another_step_are_marked(evaluated, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(evaluated, run)
    report = json.loads((run / "eval" / "passkey.json").read_text())
    (run / "eval" / "passkey.json").write_text(json.dumps({**report, "step": 5}))
    text = card(export(run, tmp_path / "out"))
    assert f"(`passkey.json`) (measured at step 5, not this export's step {STEP})" in text
