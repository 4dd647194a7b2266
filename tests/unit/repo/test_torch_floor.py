"""The torch floor is the torch CI tests: pyproject.toml's ``torch>=X.Y``, the floor goat-dist refuses an
older torch below at import (``goat_dist/compat.py``), and the ``torch==X.Y.Z`` that ``launch/setup.sh``
installs (which ``.ci/run`` runs, and the README and docs/training.md name) cannot drift apart; the refusal
names both versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from goat_dist.compat import TORCH_FLOOR, check_torch, torch_too_old

tomllib = pytest.importorskip("tomllib", reason="tomllib: Python >= 3.11")

ROOT = Path(__file__).resolve().parents[3]


def pyproject_floor() -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    found = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)", torch.strip())
    assert found, f"pyproject.toml: torch must be declared as torch>=MAJOR.MINOR, got {torch!r}"
    return tuple(map(int, found.groups()))


def setup_torch_version() -> str:
    found = re.search(
        r'TORCH_VERSION="\$\{GOAT_TORCH_VERSION:-([0-9.]+)\}"', (ROOT / "launch/setup.sh").read_text()
    )
    assert found, "launch/setup.sh: no TORCH_VERSION default"
    return found.group(1)


def test_pyprojects_floor_is_the_torch_ci_installs():
    assert "bash launch/setup.sh" in (ROOT / ".ci" / "run").read_text()  # CI's torch is the setup's
    assert "GOAT_TORCH_VERSION" not in (ROOT / ".ci" / "run").read_text()  # ... at its default
    tested = tuple(int(v) for v in setup_torch_version().split(".")[:2])
    assert pyproject_floor() == tested == TORCH_FLOOR
    for doc in ("README.md", "docs/training.md"):  # what the setup installs, as the docs name it
        named = set(re.findall(r"`torch==([0-9.]+)`", (ROOT / doc).read_text()))
        assert named == {setup_torch_version()}, f"{doc} names torch {sorted(named)}"


def test_an_older_torch_is_refused_naming_both_versions():
    floor = ".".join(map(str, TORCH_FLOOR))
    older = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.1+cu126"
    with pytest.raises(ImportError, match=re.escape(f"needs torch >= {floor}")) as refused:
        check_torch(older)
    assert f"torch {older} is installed" in str(refused.value)
    assert torch_too_old("2.4.0") is not None
    for fine in (f"{floor}.0+cpu", f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] + 1}.0a0+git1234", "3.0.0", "unknown"):
        assert torch_too_old(fine) is None, fine
        check_torch(fine)
