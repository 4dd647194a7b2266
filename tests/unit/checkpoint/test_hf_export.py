"""Hugging Face export: the directory loads with ``transformers`` alone (RoPE as LlamaForCausalLM, the other
position schemes with ``trust_remote_code``), its logits equal goat-dist's (fp32, 1e-5), GOAT's cached
generation equals uncached generation, and the tokenizer loads with AutoTokenizer."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'transformers>=4.45'"
)

from goat_dist.checkpoint import CheckpointManager  # noqa: E402
from goat_dist.checkpoint.export import export  # noqa: E402
from goat_dist.checkpoint.manager import CheckpointError  # noqa: E402
from goat_dist.model import GPT  # noqa: E402
from goat_dist.parallel.parallelize import parallelize  # noqa: E402

VARIANTS = {
    # vocab 300 pads to 384: the export cuts the padding; untied head, GQA, biases, a non-default theta
    "rope": [
        "model.position=rope",
        "model.rope_base=500",
        "model.num_kv_heads=2",
        "model.tie_embeddings=false",
        "model.bias=true",
    ],
    "goat": ["model.position=goat", "model.num_kv_heads=2"],
    # one u(j) lane (what model.goat.key_bias_lanes=auto builds under fp32: the reference's 2R+1)
    "goat-one-lane": ["model.position=goat", "model.num_kv_heads=2", "model.goat.key_bias_lanes=1"],
    "alibi": [
        "model.position=alibi",
        "model.activation=gelu",
        "model.norm=layernorm",
        "model.bias=true",
        "model.tie_embeddings=false",
    ],
    "none": ["model.position=none"],
    # the study's ablations: no sink MLP (abs_rank 0), and neither it nor K_rel (the slope and bump only)
    "goat-no-sink": ["model.position=goat", "model.goat.abs_rank=0"],
    "goat-slope-only": ["model.position=goat", "model.goat.abs_rank=0", "model.goat.pos_rank=0"],
    "learned": ["model.position=learned"],
}


def _checkpoint(run_dir, cfg, steps: int = 2):
    """(the trained goat-dist model in eval mode, run dir with its checkpoint)."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=1)
    vocab = cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (2, 33))
    positions = torch.arange(32).expand(2, -1)
    for _ in range(steps):  # move the weights (the prior included) away from their initial values
        engine.backward(engine(tokens[:, :-1], positions, tokens[:, 1:]))
        engine.step()
    state = {"step": steps, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(run_dir).save(engine, state, yaml.safe_dump(cfg.to_dict()))
    return model.eval(), run_dir


@pytest.fixture(scope="module")
def exported(world1, builtin_cache, tmp_path_factory):
    """variant -> (goat-dist model, HF export dir). GOAT is trained on the builtin data's vocabulary,
    so its run dir has the tokenizer; the others use a 300-token vocabulary (padded to 384)."""
    root = tmp_path_factory.mktemp("hf-export")
    out = {}
    for name, overrides in VARIANTS.items():
        extra = ["model.num_layers=2"]
        if name == "goat":
            extra += [
                "model.vocab_size=4096",
                f"data.cache_dir={builtin_cache}",
                "data.builtin_max_bytes=1000000",
            ]
        cfg = one_layer_config(*extra, *overrides, "train.lr=3e-2")
        model, run = _checkpoint(root / f"run-{name}", cfg)
        out[name] = (model, export(run, root / f"hf-{name}", fmt="hf"))
    return out


def _load(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()


def _goat_logits(model, tokens, positions):
    with torch.no_grad():
        return model(tokens, positions)[..., : model.vocab_size]


def test_rope_exports_as_a_plain_llama(exported):
    model, out = exported["rope"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 300 and config["rope_theta"] == 500 and not config["tie_word_embeddings"]
    assert not (out / "modeling_goat.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # no remote code
    assert type(hf).__name__ == "LlamaForCausalLM"
    torch.manual_seed(1)
    tokens = torch.randint(0, 300, (3, 24))
    positions = torch.arange(24).expand(3, -1)
    with torch.no_grad():
        got = hf(tokens).logits
    assert got.shape[-1] == 300
    assert (got - _goat_logits(model, tokens, positions)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "position", ["goat", "goat-one-lane", "alibi", "none", "learned", "goat-no-sink", "goat-slope-only"]
)
def test_remote_code_logits_match(exported, position):
    model, out = exported[position]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_goat.GoatForCausalLM"
    assert config["goat_key_bias_lanes"] == (1 if position == "goat-one-lane" else 3)  # auto, unresolved: 3
    for name in ("modeling_goat.py", "configuration_goat.py"):
        assert "SPDX-License-Identifier: Apache-2.0" in (out / name).read_text()
        assert "goat_dist" not in (out / name).read_text().replace("goat_dist_", "").replace(
            '"goat_dist"', ""
        )
    hf = _load(out)
    vocab = model.vocab_size
    torch.manual_seed(2)
    tokens = torch.randint(0, vocab, (3, 24))
    starts = [0] if position == "learned" else [0, 1000]  # an offset: positions are taken as given
    for start in starts:
        positions = torch.arange(start, start + 24).expand(3, -1)
        with torch.no_grad():
            got = hf(tokens, position_ids=positions, use_cache=False).logits
        assert got.shape[-1] == vocab
        assert (got - _goat_logits(model, tokens, positions)).abs().max().item() <= 1e-5, start


@pytest.mark.parametrize("position", ["goat", "goat-one-lane", "alibi"])
def test_cached_generation_equals_uncached(exported, position):
    """Greedy generate with the HF cache equals it without (every step re-run), and equals goat-dist's own
    greedy decoding; GOAT runs past its training length (32)."""
    model, out = exported[position]
    hf = _load(out)
    torch.manual_seed(3)
    prompt = torch.randint(0, model.vocab_size, (2, 20))
    new = 16 if position.startswith("goat") else 10
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        run = hf.generate(
            prompt,
            attention_mask=mask,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
        uncached = hf.generate(prompt, attention_mask=mask, use_cache=False, **kw)
        ids, expected = prompt, []
        for _ in range(new):
            logits = _goat_logits(model, ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1))[:, -1]
            expected.append(logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    cached = run.sequences
    assert cached.shape == (2, 20 + new)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, ids)
    for step, (got, want) in enumerate(zip(run.logits, expected)):  # each cached step's logits
        assert (got - want).abs().max().item() <= 1e-5, step


def test_tokenizer_loads_with_autotokenizer(exported, builtin_cache):
    from data_tools.builtin import builtin_dataset_dir
    from data_tools.tokenizer import load_tokenizer

    _, out = exported["goat"]
    data_dir = builtin_dataset_dir(builtin_cache, 4096, 1_000_000)
    ours = load_tokenizer(data_dir / "tokenizer.json")
    eos_id = json.loads((data_dir / "manifest.json").read_text())["eos_id"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == ours.id_to_token(eos_id) and tok.eos_token_id == eos_id
    assert tok.bos_token_id == eos_id
    text = "def read(path):\n    return open(path).read()\n"
    assert tok(text)["input_ids"] == ours.encode(text).ids
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == eos_id and config["vocab_size"] == 4096


def test_bf16_export_keeps_the_prior_fp32(exported, tmp_path):
    model, out = exported["goat"]
    run = out.parent / "run-goat"
    bf16 = export(run, tmp_path / "bf16", dtype="bf16", fmt="hf")
    hf = _load(bf16, dtype=torch.bfloat16)
    priors = {n: p for n, p in hf.named_parameters() if ".prior." in n}
    assert priors and all(p.dtype == torch.float32 for p in priors.values())
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 4096, (1, 16))
    with torch.no_grad():
        got = hf(tokens, use_cache=False).logits
    expected = _goat_logits(model, tokens, torch.arange(16)[None])
    assert (got - expected).abs().max().item() < 0.1 * expected.abs().max().item()


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (["model.activation=gelu"], "model.activation=gelu"),
        (["model.norm=layernorm"], "model.norm=layernorm"),
    ],
)
def test_rope_refuses_what_llama_cannot_express(world1, tmp_path, overrides, setting):
    cfg = one_layer_config("model.position=rope", *overrides)
    _, run = _checkpoint(tmp_path / "run", cfg, steps=0)
    with pytest.raises(CheckpointError, match=setting):
        export(run, tmp_path / "hf", fmt="hf")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["run"]


def test_unknown_format_is_refused(exported, tmp_path):
    _, out = exported["none"]
    with pytest.raises(ValueError, match="export format 'onnx'"):
        export(out.parent / "run-none", tmp_path / "x", fmt="onnx")


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["022", "027"])
def test_hf_export_modes_follow_the_umask(exported, tmp_path, mask):
    old = os.umask(mask)
    try:
        out = export(exported["goat"][1].parent / "run-goat", tmp_path / "hf", fmt="hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    files = list(out.iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json", "modeling_goat.py"} <= {
        f.name for f in files
    }
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f.name


# ---- goat-dist reads its Hugging Face exports back (generate, load_exported) -------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_load_exported_reads_the_hf_export(exported, variant):
    """``load_exported`` on an HF export (Llama or remote-code) rebuilds goat-dist's model: q/k/v fused
    again, SwiGLU's halves stacked, the vocabulary padded back; its logits are the trained model's."""
    from goat_dist.inference import load_exported

    model, out = exported[variant]
    loaded, tokenizer = load_exported(out)
    assert (tokenizer is not None) == (variant == "goat")
    assert loaded.cfg.position == model.cfg.position and loaded.vocab_size == model.vocab_size
    torch.manual_seed(4)
    tokens = torch.randint(0, model.vocab_size, (2, 24))
    positions = torch.arange(24).expand(2, -1)
    got, want = _goat_logits(loaded, tokens, positions), _goat_logits(model, tokens, positions)
    assert (got - want).abs().max().item() <= 1e-6


def test_evaluation_reads_the_hf_export(exported):
    """``eval ppl|passkey|harness --checkpoint <HF export>``: the evaluation loader maps the tensors back
    as ``load_exported`` does; the logits are the trained model's."""
    from goat_dist.evaluation.checkpoint import load_model

    model, out = exported["goat"]
    loaded = load_model(out)
    assert loaded.run_config is None and loaded.cfg.position == model.cfg.position
    torch.manual_seed(5)
    tokens = torch.randint(0, model.vocab_size, (2, 24))
    positions = torch.arange(24).expand(2, -1)
    got, want = _goat_logits(loaded.model, tokens, positions), _goat_logits(model, tokens, positions)
    assert (got - want).abs().max().item() <= 1e-6


def test_cli_generate_takes_either_export_format(exported, tmp_path, capsys):
    """``goat-dist generate`` on the HF export prints what it prints on the goat-format export of the same
    checkpoint, greedy and seeded sampling alike."""
    from goat_dist.cli import main

    _, hf = exported["goat"]
    goat = export(hf.parent / "run-goat", tmp_path / "goat-format")

    def run(model, *argv):
        code = main(
            ["generate", "--model", str(model), "--prompt", "def read(path):", "--max-new-tokens", "8", *argv]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    for argv in [(), ("--temperature", "0.9", "--top-p", "0.95", "--seed", "3")]:
        text = run(hf, *argv)
        assert text.startswith("def read(path):") and text == run(goat, *argv)


def test_generate_refuses_a_llama_export_it_cannot_compute(exported, tmp_path, capsys):
    import shutil

    from goat_dist.cli import main

    _, out = exported["rope"]
    other = tmp_path / "scaled"
    shutil.copytree(out, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (other / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(other), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope type 'yarn'" in err and str(other) in err


def test_lm_eval_hf_model_scores_the_export(exported):
    """``lm_eval --model hf`` on an export, with what the setup installs (lm-eval, and accelerate, which
    its hf model imports): lm-eval's log-likelihood of a continuation is the model's own."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM  # imports accelerate

    model, out = exported["goat"]
    lm = HFLM(pretrained=str(out), trust_remote_code=True, device="cpu", batch_size=1, dtype="float32")
    context, continuation = "def read(path):", "\n    return open(path).read()"
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    [(logprob, _)] = lm.loglikelihood([request], disable_tqdm=True)
    ids_context = lm.tok_encode(context)
    ids_all = lm.tok_encode(context + continuation)
    tokens = torch.tensor([ids_all])
    logits = _goat_logits(model, tokens, torch.arange(len(ids_all))[None])[0].log_softmax(-1)
    n = len(ids_all) - len(ids_context)
    expected = sum(logits[i - 1, ids_all[i]].item() for i in range(len(ids_all) - n, len(ids_all)))
    assert abs(logprob - expected) <= 1e-4
