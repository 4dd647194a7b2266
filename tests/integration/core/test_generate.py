"""KV-cached generation equals re-running the whole sequence; sampling is seeded; the CLI reports tokens/s.

Tiny models on one process. ``init_std=0.1`` spreads the logits (a few units) so greedy choices are
decided by margins far above fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from goat_dist.config import load_config
from goat_dist.generation import KVCache, cached_forward, check_sampling, generate_ids, next_token
from goat_dist.model import GPT

VOCAB = 300
SEQ_LEN = 32


def tiny_model(position: str, *extra: str, seed: int = 0) -> GPT:
    cfg = load_config(
        None,
        [
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_heads=4",
            f"model.seq_len={SEQ_LEN}",
            f"model.vocab_size={VOCAB}",
            "model.attention_backend=sdpa",
            "model.init_std=0.1",
            f"model.position={position}",
            *extra,
        ],
    )
    torch.manual_seed(seed)
    return GPT(cfg.model).eval()


def prompt(n: int = 5, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("position", ["goat", "rope", "alibi"])
def test_cached_greedy_equals_uncached(world1, position):
    model, ids = tiny_model(position), prompt(5)
    cached = generate_ids(model, ids, 12)
    uncached = generate_ids(model, ids, 12, use_cache=False)
    assert len(cached.new) == 12 > len(ids)
    assert cached.ids == uncached.ids


@pytest.mark.parametrize(
    "position, extra",
    [
        ("goat", ()),
        ("goat", ("model.num_kv_heads=2",)),  # GQA: the query lanes repeat per group
        ("goat", ("model.goat.key_bias=false",)),  # spectral lanes only
        ("rope", ()),
        ("alibi", ("model.num_kv_heads=2",)),
        ("learned", ()),
        ("none", ()),
    ],
)
def test_cached_logits_equal_full_sequence_logits(world1, position, extra):
    """Every step's logits (the prompt's last position, then each new token's) match the full forward."""
    model, ids = tiny_model(position, *extra), prompt(6)
    cached = generate_ids(model, ids, 10, keep_logits=True)
    with torch.no_grad():
        full = model(torch.tensor([cached.ids]), torch.arange(len(cached.ids))[None])[0, :, :VOCAB]
    expected = full[len(ids) - 1 : -1]
    assert len(cached.logits) == len(expected) == 10
    assert (torch.stack(cached.logits) - expected).abs().max().item() <= 1e-5


def test_goat_cache_past_the_training_length(world1):
    """Positions continue past model.seq_len (no sliding window); the fixed recency origin still agrees."""
    model, ids = tiny_model("goat"), prompt(8)
    cached = generate_ids(model, ids, 2 * SEQ_LEN, keep_logits=True)
    uncached = generate_ids(model, ids, 2 * SEQ_LEN, keep_logits=True, use_cache=False)
    assert len(cached.ids) > 2 * SEQ_LEN and cached.ids == uncached.ids
    assert (torch.stack(cached.logits) - torch.stack(uncached.logits)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("position", ["goat", "rope", "alibi"])
def test_bf16_cache_matches_uncached(world1, position):
    """In bf16 the cache holds bf16 keys (GOAT's prior stays fp32) and logits agree to bf16 rounding."""
    model, ids = tiny_model(position).to(torch.bfloat16), prompt(6)
    cache = KVCache(model, 1, 16)
    with torch.no_grad():
        cached_forward(model, torch.tensor([ids]), cache)
    assert cache.keys[0].dtype == torch.bfloat16
    cached = generate_ids(model, ids, 10, keep_logits=True)
    uncached = generate_ids(model, ids, 10, keep_logits=True, use_cache=False)
    got, want = torch.stack(cached.logits), torch.stack(uncached.logits)
    assert got.isfinite().all()
    assert (got - want).abs().max().item() <= 0.0625 * max(1.0, want.abs().max().item())


def test_sampling_is_seeded(world1):
    model, ids = tiny_model("goat"), prompt(5)

    def sample(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return generate_ids(model, ids, 20, temperature=1.0, generator=gen).new

    first, again, other = sample(1), sample(1), sample(2)
    assert first == again
    assert first != other
    assert first != generate_ids(model, ids, 20).new  # sampled, not greedy


def test_top_k_one_and_tiny_top_p_equal_greedy(world1):
    model, ids = tiny_model("rope"), prompt(5)
    greedy = generate_ids(model, ids, 12).new
    gen = torch.Generator().manual_seed(0)
    assert generate_ids(model, ids, 12, temperature=1.5, top_k=1, generator=gen).new == greedy
    assert generate_ids(model, ids, 12, temperature=1.5, top_p=1e-6, generator=gen).new == greedy


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    gen = torch.Generator().manual_seed(0)
    top_p = {next_token(logits, 1.0, top_p=0.7, generator=gen) for _ in range(300)}
    top_k = {next_token(logits, 1.0, top_k=3, generator=gen) for _ in range(300)}
    free = {next_token(logits, 1.0, generator=gen) for _ in range(300)}
    assert top_p == {0, 1} and top_k == {0, 1, 2} and free == {0, 1, 2, 3}


def test_generation_stops_at_eos(world1):
    model, ids = tiny_model("alibi"), prompt(5)
    greedy = generate_ids(model, ids, 12).new
    eos = greedy[4]
    stopped = generate_ids(model, ids, 12, eos_id=eos)
    assert stopped.new == greedy[: greedy.index(eos) + 1]


def test_errors_name_the_flag(world1):
    for kwargs, flag in [
        (dict(temperature=-1.0, top_k=None, top_p=None, max_new_tokens=5), "--temperature"),
        (dict(temperature=1.0, top_k=0, top_p=None, max_new_tokens=5), "--top-k"),
        (dict(temperature=1.0, top_k=None, top_p=1.5, max_new_tokens=5), "--top-p"),
        (dict(temperature=0.0, top_k=5, top_p=None, max_new_tokens=5), "--top-k"),
        (dict(temperature=1.0, top_k=None, top_p=None, max_new_tokens=0), "--max-new-tokens"),
    ]:
        with pytest.raises(ValueError, match=flag):
            check_sampling(**kwargs)
    with pytest.raises(ValueError, match="model.seq_len=32.*--max-new-tokens"):
        generate_ids(tiny_model("learned"), prompt(5), SEQ_LEN)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An export directory as ``goat-dist ckpt export`` writes it, of a tiny GOAT model."""
    from data_tools.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("exported")
    text = ["def read(path):\n    with open(path) as f:\n        return f.read()\n"] * 50
    train_bpe(text, VOCAB, out / "tokenizer.json")
    return out


def test_cli_generate_reports_tokens_per_second(world1, exported, tmp_path, capsys):
    from safetensors.torch import save_file

    from goat_dist.cli import main

    model = tiny_model("goat")
    save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()}, exported / "model.safetensors"
    )
    (exported / "config.json").write_text(json.dumps(dataclasses.asdict(model.cfg)))

    def run(*argv: str) -> tuple[int, str, str]:
        rc = main(["generate", "--model", str(exported), "--max-new-tokens", "8", *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    rc, out, err = run("--prompt", "def read(path):")
    assert rc == 0 and out.startswith("def read(path):")
    assert "8 new tokens" in err and "tokens/s (KV cache, fp32)" in err
    rc, out_nocache, err = run("--prompt", "def read(path):", "--no-cache")
    assert rc == 0 and out_nocache == out and "tokens/s (no cache" in err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def read(path):\n\nwith open(\n")
    sampling = ("--prompts-file", str(prompts), "--temperature", "0.9", "--top-p", "0.95", "--seed", "3")
    rc, sampled, err = run(*sampling)
    assert rc == 0 and "tokens/s" in err and run(*sampling)[1] == sampled
    lines = [json.loads(line) for line in sampled.splitlines()]
    assert [line["prompt"] for line in lines] == ["def read(path):", "with open("]
    assert all(line["text"].startswith(line["prompt"]) for line in lines)

    rc, _, err = run("--prompt", "x", "--top-p", "1.5", "--temperature", "1")
    assert rc == 2 and "--top-p" in err
    rc, _, err = run("--prompts-file", str(tmp_path / "missing.txt"))
    assert rc == 2 and "--prompts-file" in err
