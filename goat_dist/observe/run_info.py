"""The code version a run was made with, for TensorBoard's text tab and metrics.jsonl's start record.

Why both numbers: the package version names a release; ``git describe`` names the exact commit (and
``-dirty`` when the checkout had uncommitted changes), which is what a comparison between runs needs.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def code_version() -> str:
    """``goat-dist <version>`` plus ``(git <describe>)`` when the package runs from a git checkout."""
    try:
        version = metadata.version("goat-dist")
    except metadata.PackageNotFoundError:
        version = "unknown"
    text = f"goat-dist {version}"
    if (PACKAGE_ROOT / ".git").exists():
        try:
            described = subprocess.run(
                ["git", "describe", "--always", "--dirty", "--tags"],
                cwd=PACKAGE_ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            described = ""
        if described:
            text += f" (git {described})"
    return text
