"""`goat-dist eval harness`: lm-evaluation-harness tasks on a tiny trained checkpoint, checked against
log-probabilities computed here with the model directly."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from harness.multiproc import goat_train_command, launch_command, run

needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (pip install 'goat-dist[eval]')",
)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

# goat_python_choice: 8 completions of Python source, the builtin corpus's language; its data_files path is
# relative to the repository root, where `run` starts the command. ITEMS: (context, choices, gold index)
TASKS = Path(__file__).resolve().parents[2] / "data" / "harness"
ITEMS = [
    (d["question"], d["choices"], d["gold"])
    for d in map(json.loads, (TASKS / "goat_python_choice.jsonl").read_text().splitlines())
]
LIMIT = 7  # lm-eval scores the first LIMIT items


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_cache):
    """12 steps of the TINY model (context 64) on the small builtin corpus."""
    run_dir = tmp_path_factory.mktemp("harness") / "run"
    run(
        goat_train_command(1, ["train.max_steps=12", f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"])
    )
    return run_dir


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return {**OFFLINE, "HF_HOME": str(tmp_path / "hf")}


def tokenizer_of(run_dir: Path):
    from data_tools.tokenizer import load_tokenizer
    from goat_dist.evaluation.checkpoint import read_checkpoint

    data = read_checkpoint(run_dir)[1]["run_config"]["data"]
    (path,) = Path(data["cache_dir"]).glob("builtin-stdlib-v4096-*/tokenizer.json")
    return load_tokenizer(path)


def log_probs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log p(next token | ids[:i+1]) from one forward pass of one sequence."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens, torch.arange(len(ids))[None])[0, :, : model.vocab_size]
    return torch.log_softmax(logits.float(), dim=-1)


def direct_accuracy(model, tok, items) -> tuple[float, float]:
    """acc and acc_norm (log-likelihood over the choice's characters), each choice scored as
    " " + choice after the context, tokenized apart."""
    acc = norm = 0
    for context, choices, gold in items:
        ctx = tok.encode(context).ids
        lls = []
        for choice in choices:
            cont = tok.encode(" " + choice).ids
            lp = log_probs(model, ctx + cont[:-1])
            lls.append(sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)))
        lls = np.array(lls)
        acc += int(np.argmax(lls) == gold)
        norm += int(np.argmax(lls / np.array([len(c) for c in choices])) == gold)
    return acc / len(items), norm / len(items)


@pytest.mark.slow
@needs_lm_eval
def test_multiple_choice_accuracy_is_the_models_own_argmax(trained, tmp_path, world1, offline):
    """The command on a run directory: results JSON beside eval ppl's, acc and acc_norm equal to the
    argmax of the summed choice log-probabilities computed here."""
    from goat_dist.evaluation.checkpoint import load_model

    proc = run(
        launch_command(1, ["-m", "goat_dist", "eval", "harness", "--checkpoint", str(trained),
                           "--tasks", "goat_python_choice", "--include-path", str(TASKS),
                           "--limit", str(LIMIT), "--batch-size", "4"]),
        **offline,
    )  # fmt: skip
    report = json.loads((trained / "eval" / "harness.json").read_text())
    assert report["task"] == "harness" and report["step"] == 12 and report["max_length"] == 64
    assert report["tokenizer"].endswith("tokenizer.json") and report["limit"] == LIMIT
    assert report["n-samples"]["goat_python_choice"]["effective"] == LIMIT
    result = report["results"]["goat_python_choice"]
    acc, acc_norm = direct_accuracy(load_model(trained).model, tokenizer_of(trained), ITEMS[:LIMIT])
    assert (result["acc,none"], result["acc_norm,none"]) == (acc, acc_norm)
    assert "goat_python_choice" in proc.stdout and "acc_norm" in proc.stdout
    assert f"wrote {trained / 'eval' / 'harness.json'}" in proc.stdout


@pytest.mark.slow
@needs_lm_eval
def test_rolling_loglikelihood_and_greedy_generation_on_an_export(trained, tmp_path, world1):
    """An export directory (its own tokenizer.json): rolling log-likelihood over disjoint windows of the
    text (the last one read with a whole window of context, as lm-eval asks), and greedy decoding that
    stops at the first `until` string or after max_gen_toks."""
    from lm_eval.api.instance import Instance

    from goat_dist.checkpoint.export import export
    from goat_dist.evaluation.checkpoint import load_model
    from goat_dist.evaluation.harness import Scorer, find_tokenizer, lm_class

    out = export(trained, tmp_path / "export")
    loaded = load_model(out)
    path, eos = find_tokenizer(loaded, True)
    assert path == out / "tokenizer.json" and eos == 0
    session = SimpleNamespace(
        loaded=loaded, model=loaded.model, device=torch.device("cpu"), autocast=contextlib.nullcontext
    )
    lm = lm_class()(Scorer(session, path, eos, max_length=64, batch_size=3))
    model, tok = loaded.model, lm.scorer.tokenizer

    text = "def add(a, b):\n    return a + b\n\n" * 12
    ids = tok.encode(text).ids
    assert len(ids) > 2 * 64 and len(ids) % 64
    stream, want = [eos, *ids], 0.0  # stream[k] precedes ids[k]
    for start in range(0, len(ids), 64):  # ids[start:end], read from the 64 tokens before end
        end = min(start + 64, len(ids))
        lo = max(0, end - 64)
        lp = log_probs(model, stream[lo:end])
        want += sum(float(lp[k - lo, ids[k]]) for k in range(start, end))
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got == pytest.approx(want, rel=1e-5)

    prompt = "import os\n\n\ndef main("
    greedy = tok.encode(prompt).ids
    for _ in range(12):
        greedy.append(int(log_probs(model, greedy)[-1].argmax()))
    new = greedy[len(tok.encode(prompt).ids) :]
    assert eos not in new, "the tiny model ended its text: pick another prompt"
    full = tok.decode(new)
    stop = tok.decode(new[6:8])  # greedy decoding reaches it within 8 tokens, maybe sooner
    requests = [
        Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0),
        Instance("generate_until", {}, (prompt, {"until": ["\x00never"], "max_gen_toks": 5}), 1),
    ]
    until, capped = lm.generate_until(requests)
    assert until == full[: full.index(stop)] and len(until) < len(full)
    assert capped == tok.decode(new[:5])


# lambada_openai's rows: a passage whose last word, after one space, is the target (here Python, the tiny
# model's language)
LAMBADA_ROWS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "for name in names:\n    if name is not None:\n        yield name",
    "def add(a, b):\n    return a + b",
]


def copied_datasets_cache(root: Path) -> Path:
    """A datasets cache holding EleutherAI/lambada_openai (config default, split test) as a run with the
    hub leaves it: the parquet builder's dataset_info.json and lambada_openai-test.arrow under
    <cache>/EleutherAI___lambada_openai/default/0.0.0/<commit>/, made here from LAMBADA_ROWS."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    root.mkdir(parents=True)
    pq.write_table(pa.table({"text": LAMBADA_ROWS}), root / "test.parquet")
    cache = root / "datasets"
    builder = Parquet(
        cache_dir=str(root / "build"),
        dataset_name="lambada_openai",
        config_name="default",
        config_id="default",
        data_files={"test": str(root / "test.parquet")},
    )
    builder.download_and_prepare(output_dir=str(cache / "EleutherAI___lambada_openai/default/0.0.0/0123abc"))
    return cache


@pytest.mark.slow
@needs_lm_eval
def test_builtin_task_runs_offline_from_a_copied_datasets_cache(trained, tmp_path, world1):
    """lm-eval's own lambada_openai by name, its data from --datasets-cache (no hub, no offline variables
    set by the caller): the cache's rows are the ones scored, acc and perplexity equal to the model's own
    log-likelihoods of each passage's last word."""
    from goat_dist.evaluation.checkpoint import load_model

    cache = copied_datasets_cache(tmp_path / "copied")
    out = tmp_path / "eval"
    proc = run(
        launch_command(1, ["-m", "goat_dist", "eval", "harness", "--checkpoint", str(trained),
                           "--tasks", "lambada_openai", "--datasets-cache", str(cache), "--out", str(out)]),
        HF_HOME=str(tmp_path / "empty-home"),
    )  # fmt: skip
    assert "offline mode is enabled" in proc.stderr  # datasets' own word: the hub was not asked
    report = json.loads((out / "harness.json").read_text())
    assert report["datasets_cache"] == str(cache)
    assert report["n-samples"]["lambada_openai"] == {"original": 4, "effective": 4}
    model, tok = load_model(trained).model, tokenizer_of(trained)
    lls, greedy = [], []
    for text in LAMBADA_ROWS:  # lm-eval's split: context, " " + last word, encoded whole then apart
        context = " ".join(text.split(" ")[:-1])
        ctx = tok.encode(context).ids
        cont = tok.encode(context + " " + text.split(" ")[-1]).ids[len(ctx) :]
        lp = log_probs(model, ctx + cont[:-1])[len(ctx) - 1 :]
        lls.append(sum(float(lp[j, t]) for j, t in enumerate(cont)))
        greedy.append(all(int(lp[j].argmax()) == t for j, t in enumerate(cont)))
    result = report["results"]["lambada_openai"]
    assert result["acc,none"] == pytest.approx(np.mean(greedy))
    assert result["perplexity,none"] == pytest.approx(np.exp(-np.mean(lls)), rel=1e-4)


def test_missing_lm_eval_is_a_clear_error(monkeypatch, capsys):
    """Without lm-eval the command stops before loading anything, saying what to install."""
    from goat_dist.evaluation import commands

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    args = SimpleNamespace(eval="harness", checkpoint="/nonexistent", tasks=["x"], datasets_cache=None)
    assert commands.cmd_harness(args) == 2
    assert "lm-eval is not installed: pip install 'goat-dist[eval]'" in capsys.readouterr().err
