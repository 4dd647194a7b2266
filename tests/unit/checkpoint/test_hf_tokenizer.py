"""The Hugging Face export's tokenizer encodes a text to exactly the ids ``goat-dist data prepare`` gave it
(no BOS the model never saw), and its config's bos/eos ids are the data set manifest's end-of-text id:
for the project's own byte-level BPE and for a Llama-style file whose post-processor prepends ``<s>``.
Tokenizers are built here (no network)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import yaml
from harness.multiproc import one_layer_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from data_tools.cli import register
from data_tools.shard_format import read_manifest, split_shard_paths
from data_tools.tokenizer import train_bpe
from goat_dist.checkpoint import CheckpointManager
from goat_dist.checkpoint.export import export
from goat_dist.data import iter_documents
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

LINES = [
    "The goat climbs the hill and looks at the valley below.",
    "A tokenizer turns text into ids; every document ends with one special id.",
    "Numbers like 12, 345 and 6789 appear in text too, as do symbols: #, %, &.",
    "  indented text, trailing spaces   ",
]
DOCS = [" ".join(LINES[j % len(LINES)] for j in range(i, i + 1 + i % 3)) for i in range(12)] + [
    "a literal </s> and <s> and <|endoftext|> stay text",
]


def own_tokenizer(path):
    """The project's own: a byte-level BPE trained by ``data_tools.tokenizer.train_bpe`` (EOS id 0)."""
    train_bpe(LINES, 300, path)


def llama_tokenizer(path):
    """SentencePiece-style ``<unk> <s> </s>``, its post-processor prepending ``<s>`` (id 1) to a text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=sorted(set("".join(DOCS))),
        show_progress=False,
    )
    tok.train_from_iterator(LINES, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert tok.encode("goat").ids[0] == 1  # the BOS training must not see
    tok.save(str(path))


def prepare(root, build):
    """A data set ``goat-dist data prepare`` made from DOCS with the tokenizer ``build`` writes."""
    (root / "tok").mkdir(parents=True)
    build(root / "tok" / "tokenizer.json")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    argv = ["data", "prepare", "--input", docs, "--tokenizer", root / "tok" / "tokenizer.json"]
    args = parser.parse_args([*map(str, argv), "--out", str(root / "ds"), "--no-progress", "--workers", "0"])
    assert args.func(args) == 0
    return root / "ds"


@pytest.mark.parametrize("build", [own_tokenizer, llama_tokenizer], ids=["own-bpe", "llama-bos"])
def test_autotokenizer_encodes_as_data_prepare_did(world1, tmp_path, build, capsys):
    data = prepare(tmp_path, build)
    manifest = read_manifest(data)
    eos = manifest["eos_id"]
    cfg = one_layer_config(f"data.source={data}", f"model.vocab_size={manifest['vocab_size']}")
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    state = {"step": 0, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    CheckpointManager(tmp_path / "run").save(engine, state, yaml.safe_dump(cfg.to_dict()))
    out = export(tmp_path / "run", tmp_path / "hf", fmt="hf")

    tok = transformers.AutoTokenizer.from_pretrained(out)
    shards = [path for split in ("train", "val") for path in split_shard_paths(data, split)]
    prepared = sorted(ids.tolist() for _, ids in iter_documents(shards))
    assert sorted([*tok(text)["input_ids"], eos] for text in DOCS) == prepared
    assert sorted([*tok.encode(text), eos] for text in DOCS) == prepared
    assert tok.eos_token_id == eos and tok.bos_token_id == eos
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == eos and config["bos_token_id"] == eos
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos and generation["bos_token_id"] == eos
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False and tok_config["add_eos_token"] is False


def test_the_post_processor_keeps_what_adds_no_token():
    """ByteLevel's offset trimming stays; the template (a BOS) goes, also inside a Sequence."""
    from goat_dist.checkpoint.hf_export import without_added_tokens

    byte_level = {"type": "ByteLevel", "trim_offsets": False}
    template = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}
    assert without_added_tokens(byte_level) == byte_level
    assert without_added_tokens(template) is None
    assert without_added_tokens({"type": "Sequence", "processors": [byte_level, template]}) == byte_level
    assert without_added_tokens({"type": "BertProcessing", "sep": ["[SEP]", 2], "cls": ["[CLS]", 1]}) is None
    assert without_added_tokens(None) is None


def test_a_tokenizer_replaced_since_training_is_refused(world1, tmp_path):
    """The tokenizer file found beside the data must be the one the checkpoint's data contract names."""
    from goat_dist.checkpoint import CheckpointError

    data = prepare(tmp_path, own_tokenizer)
    manifest = read_manifest(data)
    cfg = one_layer_config(f"data.source={data}", f"model.vocab_size={manifest['vocab_size']}")
    engine = parallelize(GPT(cfg.model), cfg, grad_accum=1)
    contract = {"tokenizer_sha256": ["0" * 64]}  # trained with another tokenizer file than the one there now
    state = {"step": 0, "run_state": {}, "world": 1, "tp": 1, "dp": 1, "zero_stage": 0}
    state["data_contract"] = contract
    CheckpointManager(tmp_path / "run").save(engine, state, yaml.safe_dump(cfg.to_dict()))
    for fmt in ("goat", "hf"):
        with pytest.raises(CheckpointError, match=r"tokenizer\.json .*is not the tokenizer this checkpoint"):
            export(tmp_path / "run", tmp_path / fmt, fmt=fmt)
        assert not (tmp_path / fmt).exists()
    contract["tokenizer_sha256"] = [manifest["tokenizer_sha256"]]
    state.pop("last_save_s", None)
    CheckpointManager(tmp_path / "run2").save(engine, state, yaml.safe_dump(cfg.to_dict()))
    assert (export(tmp_path / "run2", tmp_path / "ok") / "tokenizer.json").is_file()
