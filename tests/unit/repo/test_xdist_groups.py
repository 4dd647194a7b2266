"""The suite's xdist scheduling (tests/conftest.py): a file's tests run on one worker, the files of a
SHARED_GROUPS group run on one worker together, and LONGEST_FIRST groups start first. Checked on a copy
of the conftest over trivial test files, with two real xdist workers (xdist's own ``xdist_group`` splits
such groups silently under pytest 9.2: the scheduler is what keeps them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"
TEST_FILE = """
import os

import pytest


@pytest.mark.parametrize("i", range(6))
def test_records_its_worker(i):
    print("WORKER", os.environ["PYTEST_XDIST_WORKER"])
"""


def _workers_by_file(tmp_path: Path, files: list[str]) -> tuple[dict[str, set[str]], dict[str, str]]:
    shutil.copy(CONFTEST, tmp_path / "tests" / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(TEST_FILE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-v",
         "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    first: dict[str, str] = {}  # worker -> the file of the first test it ran
    for line in out.stdout.splitlines():  # "[gw0] [ 8%] PASSED tests/x/test_a.py::test_...[0]"
        if line.startswith("[gw") and " PASSED " in line:
            path, worker = line.split(" PASSED ", 1)[1].split("::")[0], line[1:4]
            workers.setdefault(path, set()).add(worker)
            first.setdefault(worker, path)
    return workers, first


def test_a_shared_group_runs_on_one_worker_and_the_longest_first(tmp_path):
    (tmp_path / "tests").mkdir()
    shared = ["tests/integration/parallel/test_scale_out.py",
              "tests/integration/parallel/test_context_parallel_runs.py"]  # fmt: skip
    plain = ["tests/aaa/test_a.py", "tests/aaa/test_b.py"]  # first in file order
    longest = "tests/integration/slurm/test_slurm.py"  # in LONGEST_FIRST, after the shared group by name
    workers, first = _workers_by_file(tmp_path, [*plain, *shared, longest])
    assert set(workers) == {*plain, *shared, longest}
    assert all(len(w) == 1 for w in workers.values()), workers  # a file is never split
    assert workers[shared[0]] == workers[shared[1]], workers  # one worker for the shared group
    # each worker starts on a LONGEST_FIRST group, not on the files that come first by name
    assert set(first.values()) <= {*shared, longest}, first
