"""The session's layout runs for tests/integration/parallel/: two launches (2 and 4 ranks) of
tests/workers/layout_runs.py and the single-process references in this process (harness/layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.layouts import FOUR_RANK_JOBS, REFERENCES, TWO_RANK_JOBS, launch, train_here, train_jobs


@pytest.fixture(scope="session")
def references(world1, builtin_cache, tmp_path_factory) -> dict[str, Path]:
    """name -> the run dir of a single-process 10-step run (REFERENCES)."""
    base = tmp_path_factory.mktemp("layout-references")
    for name, overrides in REFERENCES.items():
        train_here(builtin_cache, base / name, *overrides)
    return {name: base / name for name in REFERENCES}


@pytest.fixture(scope="session")
def two_ranks(builtin_cache, tmp_path_factory) -> Path:
    jobs = ["tpgrads:goat", "tpgrads:rope", *train_jobs(TWO_RANK_JOBS)]
    return launch(2, tmp_path_factory.mktemp("layouts-2"), builtin_cache, jobs)


@pytest.fixture(scope="session")
def four_ranks(builtin_cache, tmp_path_factory) -> Path:
    jobs = ["grads:2:2", *train_jobs(FOUR_RANK_JOBS)]
    return launch(4, tmp_path_factory.mktemp("layouts-4"), builtin_cache, jobs)


@pytest.fixture
def layout_run(request):
    """name -> the run dir of that layout, from the launch of its world size."""

    def get(name: str) -> Path:
        launch = "two_ranks" if name in TWO_RANK_JOBS else "four_ranks"
        return request.getfixturevalue(launch) / name

    return get
