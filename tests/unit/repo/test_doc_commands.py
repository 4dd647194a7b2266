"""The commands in the README and docs/*.md (their fenced ```bash blocks) work as written.

Every command is either run here (cheap ones that need nothing but this checkout: ``--help``, ``goat-dist
plan``, the config-docs generator) or listed in NOT_RUN with the reason it is not (a GPU, a Slurm cluster,
the network, a trained run, minutes of training). Those are still checked as far as a CPU allows: a
``goat-dist`` command line parses with the real CLI and its config overrides load, every repository file
it names exists, a ``pip install`` extra exists in pyproject.toml, ``python -c`` code compiles. A new
command in a doc that matches neither list fails ``test_every_command_is_run_or_has_a_reason``.

Also here: the README's quick start stays the setup and test commands that ``.ci/run`` runs, and every
relative link in the docs (file and ``#anchor``) resolves."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```bash[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)

# Run by test_runnable_command_runs: (pattern, how). Cheap, and need nothing outside this checkout.
RUN = [
    (r"goat-dist( [a-z]+)* --help", "help"),
    (r"goat-dist plan (?!.*--materialize|.*--rehearse).*", "cli"),
    # build models on the meta device in a fake world of their own: a process of their own
    (r"goat-dist plan .*(--materialize|--rehearse).*", "cli-slow"),
    (r"python tools/config_docs\.py", "config-docs"),
    (r"python -m pip list --format=freeze > node-packages\.txt", "shell"),
]
# Not run here, each with its reason: (pattern, reason).
NOT_RUN = [
    (
        r"python3 -m venv .* launch/setup\.sh",
        "the setup step: installs torch, DeepSpeed and the rest from the network; .ci/run runs it",
    ),  # fmt: skip
    (r"python -m pytest\b.*", "the test suite itself"),
    (
        r"(goat-dist|torchrun .*-m goat_dist) train\b.*",
        "trains a model (minutes on a CPU, hours on GPUs); "
        "its arguments and config keys are checked here, its layout by test_readme_commands.py",
    ),
    (r"launch/local\.sh .*", "trains under torchrun"),
    (
        r"goat-dist study .*",
        "trains 7-21 models (up to ~45 min); tests/integration/evaluation/test_study.py runs one",
    ),
    (r"(goat-dist|torchrun .*-m goat_dist) (ckpt|generate|eval)\b.*", "needs a trained run or an export"),
    (r"goat-dist data .*", "needs your corpus, tokenizer or shards; tests/integration run these commands"),
    (
        r"goat-dist doctor\b.*",
        "times an all-reduce and a run-dir write, builds the builtin data set; "
        "tests/integration/doctor/test_doctor.py runs it",
    ),
    (
        r"(sbatch|slurm/chain\.sh) .*",
        "needs a Slurm cluster; tests/integration/slurm/test_slurm.py runs the scripts on a local Slurm",
    ),
    (r"pip (install|download) .*", "needs the network (a package index)"),
    (r"tensorboard .*", "a server that runs until stopped"),
    (r"python bench/\S+\.py", "a benchmark: minutes of measurement (figures in docs/performance.md)"),
    (r"bash bench/gpu_suite\.sh", "needs a CUDA GPU"),
    (r"bash bench/gpu_suite\.sh --dry-run", "~25 s; tests/gpu/test_suite_script.py runs it (no GPU needed)"),
    (
        r"python tests/harness/fa4_compile\.py .*",
        "needs flash-attn-4 and triton, then minutes of compiling; "
        "tests/integration/kernels/test_fa4_compile.py runs it",
    ),
    (r"python -c .*", "needs transformers and a Hugging Face export of a trained run; the code compiles"),
    (r"PLATFORM=.*", "sets a shell variable for the next command"),
]
# Paths in commands that stand for the user's own files, not this repository's.
PLACEHOLDERS = {"configs/my.yaml"}
REPO_DIRS = ("configs/", "slurm/", "launch/", "bench/", "tests/", "tools/", "docs/", "data_tools/")


def doc_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks in ``text``: continuation lines joined, a quoted string spanning
    lines kept whole."""
    out = []
    for block in FENCE.findall(text):
        pending = ""
        for line in textwrap.dedent(block).replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if words:
                out.append(pending.strip())
            pending = ""
        assert not pending, f"unclosed quote in a bash block: {pending!r}"
    return out


def words_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]) and len(words) > 1:
        words = words[1:]  # environment assignments before a command
    return words


def canonical(command: str) -> str:
    """The command as one line, comments and environment assignments dropped (what the patterns match)."""
    return shlex.join(words_of(command)).replace("'", "") if not command.startswith("python -c") else command


def classify(command: str) -> tuple[str, str]:
    """("run", how) or ("not run", why): a RUN rule first (``goat-dist ckpt --help`` runs), else the one
    NOT_RUN rule that matches; ("unclassified", ...) when none or several do."""
    line = canonical(command)
    found = [("run", how) for pattern, how in RUN if re.fullmatch(pattern, line, re.S)]
    if not found:
        found = [("not run", why) for pattern, why in NOT_RUN if re.fullmatch(pattern, line, re.S)]
    return found[0] if len(found) == 1 else ("unclassified", f"{len(found)} rules match")


COMMANDS = sorted({(d.relative_to(ROOT).as_posix(), c) for d in DOCS for c in doc_commands(d.read_text())})
IDS = [f"{doc}:{canonical(c)[:60]}" for doc, c in COMMANDS]


def goat_argv(words: list[str]) -> list[str] | None:
    """The ``goat-dist`` arguments of a command line (``goat-dist``, ``python -m goat_dist``, torchrun's
    ``-m goat_dist``, ``python -m data_tools`` = ``goat-dist data``); None for other programs."""
    if words[0] == "goat-dist":
        return words[1:]
    if words[0] in ("python", "python3") and words[1:3] == ["-m", "goat_dist"]:
        return words[3:]
    if words[0] in ("python", "python3") and words[1:3] == ["-m", "data_tools"]:
        return ["data", *words[3:]]
    if words[0] == "torchrun" and "-m" in words:
        i = words.index("-m")
        return words[i + 2 :] if words[i + 1] == "goat_dist" else None
    return None


@pytest.fixture(scope="module")
def parser():
    from goat_dist.cli import build_parser

    return build_parser()


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 60
    assert {doc for doc, _ in COMMANDS} >= {"README.md", "docs/training.md", "docs/data.md", "docs/slurm.md"}


def test_every_command_is_run_or_has_a_reason():
    found = [(doc, canonical(c), classify(c)) for doc, c in COMMANDS]
    unclassified = [(doc, c, why) for doc, c, (kind, why) in found if kind == "unclassified"]
    assert not unclassified, (
        "commands in the docs that tests/unit/repo/test_doc_commands.py neither runs nor lists with a reason "
        f"(add each to RUN or NOT_RUN): {unclassified}"
    )


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=IDS)
def test_command_names_existing_files_and_parses(doc, command, parser, capsys):
    """Static checks of every command, run or not."""
    from goat_dist.config import load_config

    words = words_of(command)
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if value.startswith(REPO_DIRS) and value not in PLACEHOLDERS and not value.startswith("tests/data/"):
            assert (ROOT / value.split(":")[0]).exists(), f"{doc}: `{command}` names {value}: not here"
    if words[:2] == ["pip", "install"]:
        section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
        extras = re.findall(r"^(\w+) *=", section.split("\n[")[0], re.M)
        for word in words:
            if m := re.fullmatch(r"goat-dist\[(\w+)\]", word):
                assert m.group(1) in extras, f"{doc}: no extra [{m.group(1)}] in pyproject.toml"
    if words[:2] == ["python", "-c"]:
        compile(words[2], f"{doc}: python -c", "exec")
    argv = goat_argv(words)
    if argv is None or "--help" in argv:
        return
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{doc}: `{canonical(command)}` does not parse: {capsys.readouterr().err}")
    overrides = getattr(args, "overrides", None)
    if isinstance(overrides, list):  # the config keys exist and take these values
        config = getattr(args, "config", None)
        config = str(ROOT / config) if config and (ROOT / config).is_file() else None
        given = any(o.startswith("model.vocab_size=") for o in overrides)
        pinned = [] if given else ["model.vocab_size=4096"]  # no data set manifest is looked up
        load_config(config, [*overrides, *pinned])


RUNNABLE = [
    pytest.param(doc, c, marks=[pytest.mark.slow] if classify(c)[1] == "cli-slow" else [], id=i)
    for (doc, c), i in zip(COMMANDS, IDS)
    if classify(c)[0] == "run"
]


@pytest.mark.parametrize(("doc", "command"), RUNNABLE)
def test_runnable_command_runs(doc, command, tmp_path, monkeypatch, capsys):
    how = classify(command)[1]
    words = words_of(command)
    if how == "help":
        from goat_dist.cli import main

        with pytest.raises(SystemExit) as stop:
            main(words[1:])
        assert stop.value.code == 0 and "usage: goat-dist" in capsys.readouterr().out
    elif how == "cli-slow":  # --materialize builds a model in a world of its own: a process of its own,
        # whatever torch.distributed state earlier tests left in this one
        proc = subprocess.run(
            [sys.executable, "-m", "goat_dist", *goat_argv(words)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0 and proc.stdout.strip(), (
            f"{doc}: `{command}` failed: {proc.stderr[-3000:]}"
        )
    elif how.startswith("cli"):
        from goat_dist.cli import main

        assert main(goat_argv(words)) == 0, f"{doc}: `{command}` failed: {capsys.readouterr().err}"
        assert capsys.readouterr().out.strip()
    elif how == "config-docs":  # writes docs/configuration.md: here into tmp_path
        spec = importlib.util.spec_from_file_location("config_docs_cmd", ROOT / "tools" / "config_docs.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        monkeypatch.setattr(module, "OUT", tmp_path / "configuration.md")
        monkeypatch.setattr(module, "ROOT", tmp_path)
        assert module.main([]) == 0
        assert (tmp_path / "configuration.md").read_text() == module.render()
    elif how == "shell":
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=90
        )
        assert proc.returncode == 0, f"{doc}: `{command}`: {proc.stderr[-2000:]}"
    else:
        pytest.fail(f"no way to run {how!r}")


def test_the_quick_start_is_what_ci_runs():
    """The README's quick start is three lines that .ci/run and tests depend on, byte for byte."""
    block = FENCE.search(README.read_text().split("## Quick start", 1)[1]).group(1)
    setup = "python3 -m venv .venv && . .venv/bin/activate && bash launch/setup.sh"
    assert block == f"{setup}\ngoat-dist train\npython -m pytest -q\n"
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci and "\npython -m pytest -q\n" in ci
    assert len(README.read_text().splitlines()) <= 250, "the README is the front door: at most 250 lines"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # headings outside code only
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", doc.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc.name}: links that do not resolve: {broken}"
