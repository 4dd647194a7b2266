"""`.ci/typecheck.py`'s comparison with its baseline, on made-up mypy output (mypy itself never runs here)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tc():
    spec = importlib.util.spec_from_file_location("ci_typecheck", ROOT / ".ci" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(file, line, message, code, severity="error"):
    return json.dumps(
        {
            "file": file,
            "line": line,
            "column": 0,
            "message": message,
            "hint": None,
            "code": code,
            "severity": severity,
        }
    )


TODAY = [
    _line("goat_dist/a.py", 10, 'Item "None" of "X | None" has no attribute "y"', "union-attr"),
    _line("goat_dist/a.py", 20, 'Item "None" of "X | None" has no attribute "y"', "union-attr"),
    _line("goat_dist/b.py", 5, 'Name "f" already defined on line 2', "no-redef"),
    _line("goat_dist/b.py", 6, "See the docs", None, severity="note"),
]


def _run(tc, tmp_path, lines, capsys, update=False):
    out = tmp_path / "mypy.jsonl"
    out.write_text("\n".join(lines) + "\n")
    argv = ["--baseline", str(tmp_path / "baseline.txt"), "--mypy-output", str(out), "--mypy-version", "9.9"]
    code = tc.main(argv + (["--update"] if update else []))
    return code, capsys.readouterr().out


@pytest.fixture
def baselined(tc, tmp_path, capsys):
    code, _ = _run(tc, tmp_path, TODAY, capsys, update=True)
    assert code == 0
    return tmp_path


def test_baseline_counts_errors_per_file_code_and_message(tc, baselined):
    text = (baselined / "baseline.txt").read_text()
    assert "2\tgoat_dist/a.py\tunion-attr\t" in text
    assert '1\tgoat_dist/b.py\tno-redef\tName "f" already defined on line N' in text  # no line numbers
    assert "See the docs" not in text  # notes are not errors
    assert tc.read_baseline(text) == tc.parse("\n".join(TODAY))[0]
    assert tc.baseline_version(text) == "9.9"


def test_same_errors_pass(tc, baselined, capsys):
    code, out = _run(tc, baselined, TODAY, capsys)
    assert code == 0, out
    assert "nothing new" in out


def test_errors_that_moved_lines_pass(tc, baselined, capsys):
    moved = [re.sub(r'"line": (\d+)', lambda m: f'"line": {int(m.group(1)) + 7}', x) for x in TODAY]
    moved[2] = moved[2].replace("on line 2", "on line 9")
    code, out = _run(tc, baselined, moved, capsys)
    assert code == 0, out


def test_a_new_error_fails_naming_it(tc, baselined, capsys):
    new = _line(
        "goat_dist/c.py", 3, 'Argument 1 to "g" has incompatible type "str"; expected "int"', "arg-type"
    )
    code, out = _run(tc, baselined, TODAY + [new], capsys)
    assert code == 1
    assert "1 new mypy error" in out
    assert 'goat_dist/c.py:3: error: Argument 1 to "g"' in out
    assert "--update" not in out


def test_one_more_of_a_baselined_error_fails(tc, baselined, capsys):
    again = _line("goat_dist/a.py", 30, 'Item "None" of "X | None" has no attribute "y"', "union-attr")
    code, out = _run(tc, baselined, TODAY + [again], capsys)
    assert code == 1
    assert "1 more than the baseline's 2" in out
    assert "goat_dist/a.py:30:" in out


def test_a_fixed_error_fails_asking_to_shrink_the_baseline(tc, baselined, capsys):
    code, out = _run(tc, baselined, TODAY[1:], capsys)
    assert code == 1
    assert "1 baselined error(s) no longer occur" in out
    assert "python .ci/typecheck.py --update" in out
    code, out = _run(tc, baselined, TODAY[1:], capsys, update=True)
    assert code == 0
    assert "1\tgoat_dist/a.py\tunion-attr\t" in (baselined / "baseline.txt").read_text()
    assert _run(tc, baselined, TODAY[1:], capsys)[0] == 0


def test_the_baseline_in_the_repository_is_the_pinned_mypy_s(tc):
    text = (ROOT / ".ci" / "typecheck-baseline.txt").read_text()
    tc.read_baseline(text)  # parses
    pin = re.search(r'"mypy==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and tc.baseline_version(text) == pin.group(1)
