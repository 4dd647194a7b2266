"""docs/configuration.md is what ``python tools/config_docs.py`` writes from the config dataclasses today,
and every config key has a doc (the comment beside its field in goat_dist/config/sections.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def config_docs():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_every_config_key_has_a_doc(config_docs):
    missing = config_docs.missing_docs()
    assert not missing, (
        "config keys without a doc: " + ", ".join(missing) + ". Write a one-line comment beside (or directly "
        "above) each field in goat_dist/config/sections.py, then run `python tools/config_docs.py`"
    )


def test_configuration_md_is_current(config_docs):
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == config_docs.render(), (
        "docs/configuration.md is stale (a config key, default or comment changed): "
        "run `python tools/config_docs.py`"
    )


def test_every_dataclass_field_is_listed(config_docs):
    from goat_dist.config import Config

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from keys(type(default), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    listed = {k.key for _, section in config_docs.collect() for k in section}
    assert listed == set(keys(Config))
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "`checkpoint.async`" in text  # the alias the loader accepts for checkpoint.async_save


def test_comments_above_and_beside_a_field_are_its_doc(config_docs):
    source = """
from dataclasses import dataclass

@dataclass
class Section:
    plain: int = 1  # beside it
    # above it,
    # on two lines
    above: int = 2
    both: str = (  # first
        "x"  # second
    )

    undocumented: int = 3
    # a comment after a blank line belongs to the next field only if it touches it

    also_undocumented: int = 4
"""
    docs = config_docs.comment_docs(source)
    assert docs[("Section", "plain")] == "beside it"
    assert docs[("Section", "above")] == "above it, on two lines"
    assert docs[("Section", "both")] == "first second"
    assert docs[("Section", "undocumented")] == ""
    assert docs[("Section", "also_undocumented")] == ""


def test_a_key_without_a_doc_is_named(config_docs):
    key = config_docs.Key("train.new_key", "int", "0", "")
    collected = [("train", [config_docs.Key("train.lr", "float", "0.003", "peak"), key])]
    assert config_docs.missing_docs(collected) == ["train.new_key"]
    assert "| `train.new_key` | `int` | `0` | (no doc) |" in config_docs.render(collected)


def test_check_mode_passes_on_the_checked_in_file(config_docs, capsys):
    assert config_docs.main(["--check"]) == 0, capsys.readouterr().err
