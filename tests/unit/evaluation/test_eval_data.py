"""Evaluation checks its data, and keeps each data set's results: ``eval ppl`` refuses data of a larger
vocabulary (always) or another tokenizer (unless ``--allow-other-tokenizer``) than training recorded, and
writes ``ppl_<data set>_<split>.json`` per data set. Also ``generate --model`` pointed at the wrong kind of
directory, and the harness's tokenizer check and offline message. In-process, on a one-layer export."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from goat_dist.atomic import sha256_file
from goat_dist.evaluation import EvalError

VOCAB = 300
SHA_OTHER = "b" * 64


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A goat-dist export of a one-layer model (context 32) with the tokenizer it was "trained" with."""
    import torch
    from safetensors.torch import save_file

    from goat_dist.config import ModelConfig
    from goat_dist.model import GPT

    cfg = ModelConfig(vocab_size=VOCAB, seq_len=32, num_layers=1, hidden_size=64, num_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    out = tmp_path_factory.mktemp("export")
    save_file(
        {k: v.detach().contiguous() for k, v in model.named_parameters()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(asdict(cfg)))
    (out / "tokenizer.json").write_text('{"model": "the tokenizer of the training data"}')
    return out


@pytest.fixture(scope="module")
def session(export, world1):
    import torch

    from goat_dist.evaluation.session import Session

    yield Session(str(export), None, None, "fp32")
    torch.set_grad_enabled(True)  # a Session turns autograd off for its process; the next tests train


def data(root, sha: str, vocab: int = VOCAB):
    """A val split of 8 documents of 40 random ids."""
    import numpy as np

    from data_tools.shard_format import write_manifest
    from data_tools.writer import ShardWriter

    rng = np.random.default_rng(zlib.crc32(str(root).encode()))  # another directory, other documents
    splits = {"train": []}
    with ShardWriter(root, "val", 1.0, vocab_size=vocab) as w:
        for d in range(8):
            w.write(f"doc-{d:05d}", rng.integers(1, vocab, 40))
    splits["val"] = w.shards
    dtype = "uint16"
    write_manifest(root, {"vocab_size": vocab, "dtype": dtype, "tokenizer_sha256": sha, "splits": splits})
    return str(root)


def ppl(session, path: str, lengths=(16, 32), tokens: int = 64, allow: bool = False) -> dict:
    from goat_dist.evaluation.reports import ppl_report

    return ppl_report(session, path, "val", list(lengths), tokens, 64, allow_other_tokenizer=allow)


def test_data_of_another_tokenizer_is_refused_unless_allowed(session, export, tmp_path):
    trained = sha256_file(export / "tokenizer.json")
    other = data(tmp_path / "other", SHA_OTHER)
    with pytest.raises(EvalError) as info:
        ppl(session, other)
    message = str(info.value)
    assert f"{other} was tokenized with another tokenizer" in message
    assert SHA_OTHER[:16] in message and trained[:16] in message and str(export / "tokenizer.json") in message
    assert "--allow-other-tokenizer" in message and "goat-dist data prepare --tokenizer" in message
    report = ppl(session, other, allow=True)
    assert report["tokenizer_check"] == "other than training (--allow-other-tokenizer)"
    assert report["tokenizer_sha256"] == SHA_OTHER and report["trained_tokenizer_sha256"] == [trained]
    assert ppl(session, data(tmp_path / "same", trained))["tokenizer_check"] == "same as training"


def test_a_larger_vocabulary_is_refused_even_when_allowed(session, tmp_path):
    """Ids past the model's vocabulary have no embedding: an error by name, not an IndexError traceback."""
    bigger = data(tmp_path / "bigger", SHA_OTHER, vocab=VOCAB + 100)
    for allow in (False, True):
        with pytest.raises(
            EvalError, match=rf"vocab_size {VOCAB + 100}, but the model has {VOCAB} token ids"
        ):
            ppl(session, bigger, allow=allow)


def test_results_are_kept_per_data_set_and_length(session, export, tmp_path):
    from goat_dist.evaluation.reports import write_ppl

    trained = sha256_file(export / "tokenizer.json")
    a, b = data(tmp_path / "set-a" / "data", trained), data(tmp_path / "set-b" / "data", trained)
    out = tmp_path / "eval"
    path_a, png_a, note = write_ppl(ppl(session, a), out)
    assert note is None and png_a.is_file() and path_a.name.startswith("ppl_data-")
    assert path_a.name.endswith("_val.json")
    before = path_a.read_bytes()
    path_b, _, note = write_ppl(ppl(session, b), out)  # same directory name, other data: another file
    assert note is None and path_b != path_a and path_a.read_bytes() == before
    assert json.loads(path_b.read_text())["data"] == b

    path, _, note = write_ppl(ppl(session, a, lengths=(64,)), out)  # more lengths of the same measurement
    merged = json.loads(path.read_text())
    assert path == path_a and note is None and [r["length"] for r in merged["results"]] == [16, 32, 64]
    assert merged["results"][:2] == json.loads(before)["results"]

    path, _, note = write_ppl(ppl(session, a, lengths=(16,), tokens=32), out)  # another token budget
    assert path == path_a and note == f"replaced {path_a} (it held step None, token_budget 64)"
    assert [r["length"] for r in json.loads(path.read_text())["results"]] == [16]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [path_a.name, path_a.with_suffix(".png").name, path_b.name, path_b.with_suffix(".png").name]
    )


def test_what_training_recorded_is_read_from_the_checkpoint(tmp_path):
    """A step directory: the tokenizers of its data contract; nothing recorded: the check says so."""
    from goat_dist.evaluation.data_check import check_data, trained_tokenizers

    step = tmp_path / "step_00000012"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"data_contract": {"tokenizer_sha256": ["a" * 64]}}))
    loaded = SimpleNamespace(source=step, cfg=SimpleNamespace(vocab_size=VOCAB))
    assert trained_tokenizers(loaded) == (["a" * 64], f"the data contract in {step / 'trainer_state.json'}")
    manifest = {"vocab_size": VOCAB, "tokenizer_sha256": SHA_OTHER, "splits": {}}
    with pytest.raises(EvalError, match="another tokenizer"):
        check_data(loaded, "d", manifest, allow_other=False)
    (step / "trainer_state.json").write_text(json.dumps({"data_contract": {"tokenizer_sha256": None}}))
    check = check_data(loaded, "d", manifest, allow_other=False)["tokenizer_check"]
    assert check == f"unverified: {step} records no tokenizer"


def test_data_labels_are_file_names():
    from goat_dist.evaluation.data_check import data_label

    assert data_label("/data/web text/", "0123456789") == "web-text-01234567"
    assert data_label("pipe:aws s3 cp s3://b/ds/{} -", "ab" * 8) == "ds-abababab"


# ---- generate --model: what it expects, what it found -----------------------------------------------
def generate(model, capsys) -> str:
    from goat_dist.cli import main

    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("goat-dist generate:") == 1 and "Traceback" not in err
    return err


def test_generate_refuses_a_run_directory_naming_the_export_step(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    err = generate(run, capsys)
    assert "expects a `goat-dist ckpt export` directory" in err and "found a run directory" in err
    assert f"goat-dist ckpt export {run} run-export" in err
    step = run / "checkpoints" / "step_00000005"
    step.mkdir()
    (step / "trainer_state.json").write_text("{}")
    assert "found a step directory" in generate(step, capsys)


def test_generate_refuses_a_hugging_face_model_goat_dist_did_not_export(tmp_path, capsys):
    """goat-dist's own HF exports load (tests/unit/checkpoint/test_hf_export.py); another model type, or
    a Llama config.json without a key goat-dist's model needs, is refused by name."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (hf / "model.safetensors").write_bytes(b"")
    err = generate(hf, capsys)
    assert "found a Hugging Face model of type 'gpt2', which goat-dist did not export" in err
    assert "llama or goat_dist" in err and "transformers" in err
    (hf / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    err = generate(hf, capsys)
    assert "lacks or mistypes 'num_attention_heads'" in err and "--format hf" in err


def test_generate_names_what_an_other_directory_holds(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("")
    assert "found notes.txt" in generate(other, capsys)
    assert "found nothing there" in generate(tmp_path / "missing", capsys)


# ---- eval harness --------------------------------------------------------------------------------------
def test_harness_refuses_another_tokenizer_unless_allowed(export, tmp_path):
    from goat_dist.evaluation.harness import check_tokenizer

    loaded = SimpleNamespace(source=export)
    assert check_tokenizer(loaded, export / "tokenizer.json", False) == "same as training"
    other = tmp_path / "tokenizer.json"
    other.write_text("{}")
    with pytest.raises(EvalError, match="not the one the model was trained with .* --allow-other-tokenizer"):
        check_tokenizer(loaded, other, False)
    assert check_tokenizer(loaded, other, True) == "other than training (--allow-other-tokenizer)"


def test_a_task_whose_data_cannot_be_had_says_how_to_run_it_offline(monkeypatch):
    from goat_dist.evaluation.harness import OFFLINE_VARS, unloadable

    for name in OFFLINE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    error = ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)")
    message = unloadable("lambada_openai", error)
    assert message.startswith("lm-eval task lambada_openai: its data set could not be loaded")
    assert "HF_DATASETS_OFFLINE set" in message and "--include-path DIR" in message
    assert "HF_DATASETS_CACHE" in message
    assert unloadable("mine", KeyError("doc_to_text")) == (
        "lm-eval task mine could not be built (KeyError: 'doc_to_text'); fix the task or its YAML file"
    )


def loaded_with(data: dict | None, source: str = "runs/x/checkpoints/step_00000010"):
    return SimpleNamespace(run_config=None if data is None else {"data": data}, source=source)


def test_the_default_data_is_what_the_run_trained_on(monkeypatch):
    """``eval ppl`` without --data reads the run's own data sets: its sources, its source path, the builtin
    corpus only when it trained on it; an export or a synthetic run says to pass --data."""
    from goat_dist.evaluation import session

    monkeypatch.setattr(session, "builtin_data", lambda loaded, is_main: "/cache/builtin-stdlib-4096")
    mix = {"sources": [{"path": "/d/web", "weight": 0.7}, {"path": "/d/code", "weight": 0.3}]}
    assert session.run_data_sets(loaded_with(mix), True) == ["/d/web", "/d/code"]
    assert session.run_data_sets(loaded_with({"source": "/d/kernel-docs"}), True) == ["/d/kernel-docs"]
    assert session.run_data_sets(loaded_with({"source": "builtin"}), True) == ["/cache/builtin-stdlib-4096"]
    with pytest.raises(EvalError, match="records no training data.*pass --data"):
        session.run_data_sets(loaded_with(None, "exports/m"), True)
    with pytest.raises(EvalError, match="data.synthetic=passkey.*pass --data"):
        session.run_data_sets(loaded_with({"source": "builtin", "synthetic": "passkey"}), True)
    assert session.run_data_sets(loaded_with(None), True, required=False) == []
