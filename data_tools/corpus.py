"""A small real text corpus that exists offline on every machine: the Python standard library.

Why: the default `goat-dist train` must work without network access or downloaded data sets. The
standard library's docstrings are English prose and its sources are real code, which is enough
for smoke tests, throughput runs and small convergence checks.
"""

from __future__ import annotations

import ast
import os
import sysconfig

# Directory names skipped anywhere under the stdlib: third-party packages, test suites, GUI
# tooling, vendored wheels and codec tables (huge data, not language).
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "lib-dynload",
        "__pycache__",
        "__phello__",
    }
)


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(("config-", "."))


def _skip_file(name: str) -> bool:
    # _sysconfigdata* is generated build data (compiler flags, paths), not prose or real code.
    return not name.endswith(".py") or name.startswith(("_sysconfigdata", "test_"))


def stdlib_module_paths(root: str | None = None) -> list[str]:
    """All candidate `.py` files under the stdlib in a deterministic (sorted, top-down) order."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not _skip_file(f))
    return paths


def _docstrings(tree: ast.AST) -> list[str]:
    """Module, class and function docstrings in source order (depth first)."""
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def module_document(path: str) -> str | None:
    """One document for a module: its docstrings (prose) followed by the full source (code).

    Returns None when the file cannot be read, decoded as UTF-8 or parsed.
    """
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return None
    if not source.strip():
        return None
    docs = _docstrings(tree)
    return "\n\n".join([*docs, source]) if docs else source


def _truncate_utf8(text: str, max_bytes: int) -> str:
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def stdlib_documents(max_bytes: int = 8_000_000) -> list[str]:
    """Documents built from the stdlib of the running Python, at most `max_bytes` of UTF-8 in total.

    Deterministic for a given Python install. Whole modules are taken in path order; the module
    that crosses the cap is truncated to fit and collection stops there.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    docs: list[str] = []
    total = 0
    for path in stdlib_module_paths():
        doc = module_document(path)
        if doc is None:
            continue
        size = len(doc.encode("utf-8"))
        if total + size > max_bytes:
            rest = _truncate_utf8(doc, max_bytes - total)
            if rest:
                docs.append(rest)
            break
        docs.append(doc)
        total += size
    return docs
