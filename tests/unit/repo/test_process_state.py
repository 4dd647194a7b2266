"""The parallel layout is passed, not looked up: only ``goat_dist/distributed.py`` (which creates the layout)
and ``goat_dist/parallel/`` read megatron-core's process-global ``parallel_state``; the model is built plain
(``GPT.__init__`` calls nothing in ``goat_dist.parallel``: ``parallelize`` sets it up); and every attribute
the forward reads is declared on the class or set by its constructor."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "goat_dist"
ALLOWED = {PACKAGE / "distributed.py", PACKAGE / "parallel"}


def _allowed(path: Path) -> bool:
    return any(path == a or a in path.parents for a in ALLOWED)


def parallel_state_reads(path: Path) -> list[str]:
    """Lines of ``path`` that name megatron's ``parallel_state`` in code (imports, names, attributes)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        if any(n.split(".")[-1] == "parallel_state" for n in names):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_only_distributed_and_parallel_read_megatrons_process_state():
    reads = [r for p in sorted(PACKAGE.rglob("*.py")) if not _allowed(p) for r in parallel_state_reads(p)]
    assert reads == [], f"parallel_state read outside distributed.py and parallel/: {reads}"


def test_the_check_sees_a_read(tmp_path):
    sample = PACKAGE / "distributed.py"
    assert parallel_state_reads(sample), "the AST check found nothing where parallel_state is read"


def _gpt_class() -> tuple[ast.Module, ast.ClassDef]:
    tree = ast.parse((PACKAGE / "model" / "gpt.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPT")
    return tree, cls


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_gpt_init_calls_nothing_in_parallel():
    tree, cls = _gpt_class()
    from_parallel = {
        a.asname or a.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallel") and node.level
        for a in node.names
    }
    assert "plain_call" in from_parallel  # the check looks at the names gpt.py takes from parallel/
    calls = []
    for node in ast.walk(_method(cls, "__init__")):
        if isinstance(node, ast.Call):
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in from_parallel:
                calls.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    assert calls == [], f"GPT.__init__ calls into goat_dist.parallel: {calls}"


def test_attributes_the_forward_reads_are_declared():
    _, cls = _gpt_class()
    declared = {
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assigned = {
        t.attr
        for node in ast.walk(_method(cls, "__init__"))
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    undeclared = set()
    for name in ("forward", "hidden_states", "vocab_parallel_logits"):
        for node in ast.walk(_method(cls, name)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                if node.attr not in declared | methods | assigned | {"training"}:
                    undeclared.add(f"{name}: self.{node.attr}")
    assert undeclared == set(), f"the forward reads attributes the class never declares: {sorted(undeclared)}"
    # the ones parallelize replaces are declared as class annotations, with their types
    for replaced in ("into_sequence_region", "tied_output_input", "block_call", "context", "compile_clock"):
        assert replaced in declared, replaced
