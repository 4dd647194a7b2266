"""The command is ``goat-dist``: installing the reference package (whose script is ``goat``) after the
project must not take it over."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_goat_dist_survives_installing_the_reference_afterwards():
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--force-reinstall",
            "--no-deps",
            "goat-attention==0.1.1",
        ],
        check=True,
        timeout=300,
    )
    exe = shutil.which("goat-dist", path=str(Path(sys.executable).parent))
    assert exe, "goat-dist is not installed next to this Python"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Pretrain decoder LMs with GOAT" in out.stdout
    for command in ("train", "data", "ckpt", "generate"):
        assert command in out.stdout
    out = subprocess.run([sys.executable, "-m", "goat_dist", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout
