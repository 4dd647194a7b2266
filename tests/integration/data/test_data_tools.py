"""data_tools on its own: torch-free CLI (`python -m data_tools`), and the builtin data set built by
the same pipeline as `prepare`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data_tools.builtin import prepare_builtin_dataset
from data_tools.corpus import stdlib_documents
from data_tools.prepare import prepare
from data_tools.shard_format import TOKENIZER_NAME, read_manifest

HEAVY = ("torch", "megatron", "deepspeed", "webdataset")

# Runs `python -m data_tools ARGS` in this interpreter, then reports which heavy modules got imported.
RUN_AND_REPORT = """
import json, runpy, sys
sys.argv = ["data_tools", *json.loads(sys.argv[1])]
try:
    runpy.run_module("data_tools", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exn:
    code = exn.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("\\nREPORT " + json.dumps({{"code": code, "heavy": heavy}}))
"""


def data_tools_cli(*args, cwd: Path) -> tuple[dict, str]:
    """Exit code and heavy modules of one `python -m data_tools` run, plus its output."""
    script = RUN_AND_REPORT.format(heavy=HEAVY)
    argv = json.dumps([str(a) for a in args])
    proc = subprocess.run(
        [sys.executable, "-c", script, argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.rsplit("REPORT ", 1)[1])
    return report, proc.stdout + proc.stderr


def test_cli_runs_without_torch(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = stdlib_documents(60_000)
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer, out = tmp_path / TOKENIZER_NAME, tmp_path / "ds"
    runs = [
        ("tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--out", tokenizer),
        (
            "prepare",
            "--input",
            corpus,
            "--tokenizer",
            tokenizer,
            "--out",
            out,
            "--workers",
            1,
            "--no-progress",
        ),
        ("inspect", out, "--decode", 1),
    ]
    for args in runs:
        report, output = data_tools_cli(*args, cwd=tmp_path)
        assert report == {"code": 0, "heavy": []}, (args, output)
    assert "0 corrupt shard(s)" in output
    manifest = read_manifest(out)
    assert manifest["command"].startswith("python -m data_tools prepare --input ")
    assert sum(e["n_docs"] for s in manifest["splits"].values() for e in s) == len(docs)

    proc = subprocess.run(
        [sys.executable, "-m", "data_tools", "inspect", tmp_path / "nope"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "python -m data_tools inspect: error:" in proc.stderr


def test_builtin_is_prepare_on_the_stdlib_corpus(tmp_path):
    """Same split, same encoding, same sample keys: `prepare` on the builtin corpus with the builtin's
    tokenizer and val count writes byte-identical shards."""
    max_bytes = 200_000
    built = prepare_builtin_dataset(
        tmp_path / "cache", vocab_size=400, max_bytes=max_bytes, log=lambda _: None
    )
    manifest = read_manifest(built)
    n_val = sum(e["n_docs"] for e in manifest["splits"]["val"])
    assert n_val >= 1

    corpus = tmp_path / "corpus.jsonl"
    docs = stdlib_documents(max_bytes)
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "prepared"
    prepare(
        [corpus],
        built / TOKENIZER_NAME,
        out,
        workers=0,
        shard_size_mb=1,
        val_docs=n_val,
        show_progress=False,
        echo=lambda _: None,
    )
    assert read_manifest(out)["splits"] == manifest["splits"]
