"""The package's import floors: every top-level unit of ``goat_dist`` (a package or a module) imports only
units on a lower floor, so the import graph is acyclic and a reader knows which way dependencies run; and
each package's ``__init__`` docstring names what it may import, which this test holds it to. Some
third-party packages are one unit's alone (``RESTRICTED``): only ``goat_dist/engine/`` imports
``deepspeed``, so that DeepSpeed's API and behaviour are assumed in one place.

Every import counts, the lazy ones inside functions included; ``if TYPE_CHECKING:`` blocks do not (they
never run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "goat_dist"

FLOORS = [
    {"atomic", "compat", "shapes", "precision", "collectives", "rampup", "lifeline"},  # stdlib, torch at most
    {"config"},
    {"distributed", "kernels"},
    {"launcher", "goat", "engine", "data", "optim", "run_lock"},
    {"parallel"},
    {"model"},
    {"generation", "observe"},
    {"inference"},
    {"checkpoint", "doctor"},
    {"trainer", "evaluation", "plan"},
    {"rehearsal"},
    {"cli"},
    {"__main__"},
]
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}

# third-party packages that only the named units may import
RESTRICTED = {"deepspeed": {"engine"}}


def _unit(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) == 1 else rel.parts[0]


def _module_parts(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return parts if parts[-1] != "__init__" else parts  # a package's __init__ counts as inside it


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_units(path: Path) -> set[str]:
    """The top-level ``goat_dist`` units that ``path`` imports (other than its own)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    parts = _module_parts(path)
    targets = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            targets += names
        elif isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
    units = {t.split(".")[1] for t in targets if t.startswith("goat_dist.") and t.count(".") >= 1}
    return units - {_unit(path)}


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the absolute imports in ``source`` (``deepspeed`` for ``from
    deepspeed.utils import x``), lazy ones included, ``TYPE_CHECKING`` blocks left out."""
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    names = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names


def restricted_imports(path: Path, source: str | None = None) -> set[str]:
    """The ``RESTRICTED`` packages ``path`` imports although its unit may not."""
    unit = _unit(path)
    found = third_party_imports(path.read_text() if source is None else source)
    return {name for name in found & set(RESTRICTED) if unit not in RESTRICTED[name]}


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_has_a_floor():
    units = {_unit(p) for p in SOURCES} - {"__init__"}
    assert units <= set(FLOOR), f"units without a floor: {sorted(units - set(FLOOR))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down(path):
    unit = _unit(path)
    if unit == "__init__":
        return
    upward = {u for u in imported_units(path) if FLOOR.get(u, -1) >= FLOOR[unit]}
    assert not upward, (
        f"{path.relative_to(PACKAGE.parent)} (floor {FLOOR[unit]}: {unit}) imports "
        + ", ".join(f"{u} (floor {FLOOR.get(u)})" for u in sorted(upward))
    )


PACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_docstring_names_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    found = re.search(r"May import:([^\n]*(?:\n(?!\n)[^\n]*)*)", doc)
    assert found, f"{package.name}/__init__.py: the docstring has no 'May import:' line"
    allowed = found.group(1).split("never")[0]  # what follows "never" is named to be excluded
    declared = set(re.findall(r"``goat_dist\.(\w+)``", allowed))
    used = set().union(*(imported_units(p) for p in package.rglob("*.py")))
    assert used <= declared, f"{package.name} imports {sorted(used - declared)}, not in its 'May import:'"
    assert declared <= set(FLOOR), f"{package.name}: unknown units {sorted(declared - set(FLOOR))}"


def test_a_cycle_would_be_caught(tmp_path):
    """The checker sees lazy imports and relative ones: the test above would fail on an upward import."""
    fake = PACKAGE / "config" / "checks.py"
    tree_units = imported_units(fake)
    assert "shapes" in tree_units  # config's lazy ``from ..shapes import ...`` inside a function
    assert FLOOR["shapes"] < FLOOR["config"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_restricted_packages_are_imported_only_where_allowed(path):
    found = restricted_imports(path)
    assert not found, f"{path.relative_to(PACKAGE.parent)} imports " + ", ".join(
        f"{name} (only {sorted(RESTRICTED[name])} may)" for name in sorted(found)
    )


def test_a_deepspeed_import_outside_the_engine_would_be_caught():
    """Lazy, aliased or submodule imports of DeepSpeed outside ``engine/`` fail the test above; inside it,
    or under ``TYPE_CHECKING``, they do not."""
    outside, inside = PACKAGE / "trainer" / "trainer.py", PACKAGE / "engine" / "build.py"
    for source in (
        "import deepspeed",
        "def f():\n    from deepspeed.utils import safe_get_full_grad\n",
        "import deepspeed.comm as dc",
    ):
        assert restricted_imports(outside, source) == {"deepspeed"}, source
        assert restricted_imports(inside, source) == set(), source
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import deepspeed\n"
    assert restricted_imports(outside, typing_only) == set()
    assert restricted_imports(outside, "from .deepspeed_notes import x") == set()  # relative: ours
