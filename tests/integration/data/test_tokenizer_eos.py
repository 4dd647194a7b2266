"""Any tokenizer file: `data prepare` ends documents with the file's own end-of-text token (GPT-2's
`<|endoftext|>`, Llama-2's `</s>`, Llama-3's `<|end_of_text|>`) or `--eos-token`; `tokenizer train`
makes `--out`'s directory; `model.vocab_size` left out is the data set's. Tokenizers are trained here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from harness.multiproc import assert_config_is_the_runs, goat_train_command, per_step
from harness.multiproc import run as run_cmd
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from data_tools.cli import register
from data_tools.shard_format import read_manifest, split_shard_paths
from goat_dist.config import DEFAULT_VOCAB_SIZE, ConfigError, load_config
from goat_dist.data import iter_documents

TINY_YAML = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"  # sets model.vocab_size: 4096
LINES = [
    "The goat climbs the hill and looks at the valley below.",
    "Attention priors tell a model where to look before it has learned anything.",
    "A tokenizer turns text into ids; every document ends with one special id.",
    "Shards hold documents, a manifest lists the shards, and the trainer reads both.",
    "Llama and GPT tokenizers name their end-of-text token differently.",
    "Numbers like 12, 345 and 6789 appear in text too, as do symbols: #, %, &.",
]
# documents for `prepare`: the lines in varying combinations, plus literal special-token strings (text)
DOCS = [" ".join(LINES[j % len(LINES)] for j in range(i, i + 1 + i % 4)) for i in range(60)] + [
    "a literal </s> and <|endoftext|> and <|end_of_text|> stay text",
]


def _bpe(special: list[str], byte_level: bool, vocab_size: int = 300, unk: str | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=unk))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = sorted(set("".join(DOCS)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(LINES, trainer=trainer)
    return tok


def gpt2_tokenizer() -> Tokenizer:
    tok = _bpe(["<|endoftext|>"], byte_level=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def llama2_tokenizer() -> Tokenizer:
    """SentencePiece-style: `<unk>` `<s>` `</s>` (ids 0-2), BOS added by the post-processor, EOS not."""
    tok = _bpe(["<unk>", "<s>", "</s>"], byte_level=False, unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def llama3_tokenizer() -> Tokenizer:
    """Byte-level with `<|begin_of_text|>` (added by the post-processor) and both `<|end_of_text|>` and the
    chat turn end `<|eot_id|>`."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
    tok = _bpe([*special, "<|eot_id|>"], byte_level=True)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    return tok


def bert_tokenizer() -> Tokenizer:
    """No end-of-text token by name: its post-processor's `[CLS] $A [SEP]` says which one ends a sequence."""
    tok = _bpe(["[UNK]", "[CLS]", "[SEP]", "[PAD]"], byte_level=False, unk="[UNK]")
    tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    return tok


def no_eos_tokenizer() -> Tokenizer:
    return _bpe(["<unk>", "<pad>"], byte_level=False, unk="<unk>")


STYLES = {
    "gpt2": (gpt2_tokenizer, "<|endoftext|>"),
    "llama2": (llama2_tokenizer, "</s>"),
    "llama3": (llama3_tokenizer, "<|end_of_text|>"),
    "bert": (bert_tokenizer, "[SEP]"),
}


def goat(*argv) -> int:
    """`goat-dist data ARGV` through the argparse entry point the CLI uses."""
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *map(str, argv)])
    return args.func(args)


def save(tok: Tokenizer, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_docs(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def prepare(inputs: Path, tokenizer: Path, out: Path, *extra) -> int:
    args = ["prepare", "--input", inputs, "--tokenizer", tokenizer, "--out", out, "--no-progress"]
    return goat(*args, "--workers", 0, "--val-docs", 3, *extra)


def documents(out: Path) -> list:
    return [ids for split in ("train", "val") for _, ids in iter_documents(split_shard_paths(out, split))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_docs(tmp_path_factory.mktemp("corpus") / "docs.jsonl", DOCS)


@pytest.fixture(scope="module")
def llama_dataset(corpus, tmp_path_factory) -> Path:
    """A data set prepared with the Llama-2-style tokenizer (`</s>`)."""
    d = tmp_path_factory.mktemp("llama")
    assert prepare(corpus, save(llama2_tokenizer(), d / "tok" / "tokenizer.json"), d / "ds") == 0
    return d / "ds"


# ---------------------------------------------------------------- data prepare: which EOS


@pytest.mark.parametrize("style", list(STYLES))
def test_prepare_ends_documents_with_the_tokenizers_own_eos(style, corpus, tmp_path, capsys):
    build, expected = STYLES[style]
    tok = build()
    tokenizer = save(tok, tmp_path / "tokenizer.json")
    out = tmp_path / "ds"
    assert prepare(corpus, tokenizer, out) == 0, capsys.readouterr().err
    eos = tok.token_to_id(expected)
    manifest = read_manifest(out)
    assert manifest["eos_token"] == expected and manifest["eos_id"] == eos
    assert f"ends with {expected!r} (id {eos})" in capsys.readouterr().out
    docs = documents(out)
    assert len(docs) == len(DOCS)
    # EOS only at the end: the literal "</s>" / "<|endoftext|>" strings of the last document are text
    assert all(ids[-1] == eos and eos not in ids[:-1] for ids in docs)
    # inspect decodes with any tokenizer file, not only one holding <|endoftext|>
    assert goat("inspect", out, "--decode", 1) == 0
    assert expected in capsys.readouterr().out


def test_eos_token_option_overrides_the_default(corpus, tmp_path, capsys):
    tok = llama3_tokenizer()
    tokenizer = save(tok, tmp_path / "tokenizer.json")
    out = tmp_path / "ds"
    assert prepare(corpus, tokenizer, out, "--eos-token", "<|eot_id|>") == 0, capsys.readouterr().err
    eot = tok.token_to_id("<|eot_id|>")
    manifest = read_manifest(out)
    assert manifest["eos_token"] == "<|eot_id|>" and manifest["eos_id"] == eot != tok.token_to_id("</s>")
    assert manifest["command"].endswith("--eos-token '<|eot_id|>'")
    assert all(ids[-1] == eot and eot not in ids[:-1] for ids in documents(out))
    capsys.readouterr()
    # the EOS is part of what a finished data set was built with: another one is refused, not reused
    assert prepare(corpus, tokenizer, out, "--eos-token", "<|end_of_text|>") == 2
    assert "built from other inputs or arguments" in capsys.readouterr().err
    assert prepare(corpus, tokenizer, out, "--eos-token", "<|eot_id|>") == 0
    assert "nothing to do" in capsys.readouterr().out


def test_eos_errors_name_the_token_and_the_file(corpus, tmp_path, capsys):
    none = save(no_eos_tokenizer(), tmp_path / "plain.json")
    assert prepare(corpus, none, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert f"tokenizer file {none} declares no end-of-text token" in err
    assert "<unk>, <pad>" in err and "pass --eos-token" in err
    assert not (tmp_path / "a").exists()  # refused before any output

    llama = save(llama2_tokenizer(), tmp_path / "llama.json")
    assert prepare(corpus, llama, tmp_path / "b", "--eos-token", "<|endoftext|>") == 2
    err = capsys.readouterr().err
    assert f"tokenizer file {llama} has no token '<|endoftext|>' (--eos-token)" in err
    assert "<unk>, <s>, </s>" in err


# ---------------------------------------------------------------- tokenizer train --out


def test_tokenizer_train_creates_the_out_directory(corpus, tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "tok.json"
    train = ["tokenizer", "train", "--input", corpus, "--vocab-size", 300]
    assert goat(*train, "--out", out) == 0
    assert Tokenizer.from_file(str(out)).token_to_id("<|endoftext|>") == 0
    blocker = tmp_path / "file"
    blocker.write_text("x")
    capsys.readouterr()
    assert goat(*train, "--out", blocker / "t.json") == 2
    assert "goat-dist data tokenizer train: error:" in capsys.readouterr().err


# ---------------------------------------------------------------- model.vocab_size from the manifest


def test_vocab_size_defaults_to_the_manifest(llama_dataset, tmp_path):
    from goat_dist.data.batches import data_sources
    from goat_dist.model import padded_vocab_size

    vocab = read_manifest(llama_dataset)["vocab_size"]
    assert vocab != DEFAULT_VOCAB_SIZE
    config = tmp_path / "no_vocab.yaml"
    config.write_text(yaml.safe_dump({"model": {"num_layers": 2}, "data": {"source": str(llama_dataset)}}))
    cfg = load_config(config)
    assert cfg.model.vocab_size == vocab
    assert padded_vocab_size(cfg.model.vocab_size, cfg.model.vocab_pad_multiple, 1) == -(-vocab // 128) * 128
    for spelled in ("null", "auto"):  # asked for explicitly, also over a file that sets it
        over = load_config(TINY_YAML, [f"data.source={llama_dataset}", f"model.vocab_size={spelled}"])
        assert over.model.vocab_size == vocab
    mixture = load_config(None, [f"data.sources=[{{path: {llama_dataset}, weight: 2}}]"])
    assert mixture.model.vocab_size == vocab
    # no manifest to read: the default, as before
    assert load_config(None, []).model.vocab_size == DEFAULT_VOCAB_SIZE  # builtin corpus
    assert load_config(None, ["data.synthetic=passkey"]).model.vocab_size == DEFAULT_VOCAB_SIZE
    missing = load_config(None, [f"data.source={tmp_path / 'missing'}"])
    assert missing.model.vocab_size == DEFAULT_VOCAB_SIZE

    # a size the user set stays: larger is fine, smaller than the data's is still an error
    assert load_config(TINY_YAML, [f"data.source={llama_dataset}"]).model.vocab_size == 4096
    small = load_config(None, [f"data.source={llama_dataset}", f"model.vocab_size={vocab - 1}"])
    assert small.model.vocab_size == vocab - 1
    with pytest.raises(ConfigError, match=f"vocab_size {vocab}, larger than model.vocab_size={vocab - 1}"):
        data_sources(small, SimpleNamespace(is_main=True, local_rank=0))
    with pytest.raises(ConfigError, match="model.vocab_size"):
        load_config(None, ["model.vocab_size=0"])


# ---------------------------------------------------------------- a Llama-style data set trains


@pytest.mark.slow
def test_llama_style_dataset_trains_and_resumes(llama_dataset, tmp_path):
    """`</s>` data, model.vocab_size from its manifest: 4 steps with a checkpoint at 2 and 4, then on to 6."""
    run_dir = tmp_path / "run"
    common = [
        f"data.source={llama_dataset}",
        "model.vocab_size=auto",
        "checkpoint.interval=2",
        f"run.dir={run_dir}",
    ]
    run_cmd(goat_train_command(1, [*common, "train.max_steps=4"]))
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] == read_manifest(llama_dataset)["vocab_size"]
    again = run_cmd(goat_train_command(1, [*common, "train.max_steps=6"]))
    assert "resumed from" in again.stdout and "step 4" in again.stdout
    assert sorted(per_step(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert assert_config_is_the_runs(run_dir)["model"]["vocab_size"] == saved["model"]["vocab_size"]
