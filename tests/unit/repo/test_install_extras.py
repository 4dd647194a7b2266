"""What the README's setup (``launch/setup.sh``) installs covers the documented uses of what it installs:
``lm_eval --model hf`` on a Hugging Face export imports accelerate and transformers, so every extra that
brings lm-eval (the test extra the setup installs, and ``eval``) brings them too; and the setup installs
its packages with the torch it installed first pinned, so none of them can replace the CPU wheel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib: Python >= 3.11")

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
SETUP = (ROOT / "launch" / "setup.sh").read_text()


def names(requirements: list[str]) -> dict[str, str]:
    """Requirement name (lower case) -> its version specifier."""
    out = {}
    for req in requirements:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)", req)
        assert m, req
        out[m.group(1).lower()] = m.group(3).strip()
    return out


WITH_LM_EVAL = sorted(extra for extra, reqs in EXTRAS.items() if "lm-eval" in names(reqs))


def test_the_setup_installs_the_test_extra():
    assert re.search(r'pip install .*-e "\.\[test\]"', SETUP)
    assert "test" in WITH_LM_EVAL and "eval" in WITH_LM_EVAL


@pytest.mark.parametrize("extra", WITH_LM_EVAL)
def test_an_extra_with_lm_eval_has_what_its_hf_model_imports(extra):
    """lm-eval's ``hf`` model (lm_eval/models/huggingface.py) imports accelerate and transformers at the
    top; lm-eval itself requires neither."""
    declared = names(EXTRAS[extra])
    assert "accelerate" in declared, f"[{extra}] brings lm-eval without accelerate"
    assert "transformers" in declared, f"[{extra}] brings lm-eval without transformers"
    assert declared["accelerate"], f"[{extra}]: accelerate without a version"


def test_the_test_extra_pins_accelerate_exactly():
    """The suite's environment is reproducible: the test extra pins lm-eval, and accelerate with it."""
    assert re.fullmatch(r"==\d+(\.\d+)+", names(EXTRAS["test"])["accelerate"])


def test_every_install_after_torch_keeps_the_installed_torch():
    """Each ``pip install`` after torch's is constrained to the installed torch (``-c`` a file holding
    ``torch==<its version>``), so no dependency resolves a CUDA build over the CPU wheel."""
    assert "print('torch==' + torch.__version__)" in SETUP
    lines = [line.strip() for line in SETUP.splitlines() if re.search(r"\bpip install\b", line)]
    after_torch = [
        line for line in lines if "torch==${TORCH_VERSION}" not in line and "--upgrade pip" not in line
    ]
    assert len(after_torch) >= 3
    for line in after_torch:
        assert '-c "$torch_pin"' in line, line
