import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", module="megatron")

# pytest-xdist (pyproject's addopts: ``-n auto --dist loadgroup``) runs the suite in a few worker processes:
# one test launching processes leaves a core idle while its processes import or wait. Workers never split
# a file: every test is in the xdist group of its file unless it names a group itself, so a module-scoped
# fixture trains its run once, and tests that must not overlap (one private Slurm cluster, fixed ports)
# stay in order on one worker. Tests of several files that share an expensive session fixture name one
# group (``pytest.mark.xdist_group("...")``) to share one worker and the fixture.
ROOT = Path(__file__).resolve().parent.parent
MAX_WORKERS = 2


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most MAX_WORKERS (the multi-process tests start 2-4 processes
    each; more workers only oversubscribe the cores). ``-n N`` or PYTEST_XDIST_AUTO_NUM_WORKERS override."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(Path(item.fspath).relative_to(ROOT).as_posix()))


@pytest.fixture(scope="session")
def world1():
    """A single-process torch.distributed + megatron parallel_state world (TP=1)."""
    from goat_dist import distributed

    layout = distributed.init(tp=1)
    yield layout


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A small builtin dataset shared by the tests (the real one is 8 MB; this is 1 MB)."""
    from data_tools.builtin import prepare_builtin_dataset

    cache = tmp_path_factory.mktemp("goat-cache")
    prepare_builtin_dataset(cache, vocab_size=4096, max_bytes=1_000_000, log=lambda *a: None)
    return cache


@pytest.fixture
def fa4():
    """The FlashAttention-4 stand-in (tests/harness/flash4_standin.py), fp32 allowed (exact comparisons),
    playing an H100/H200 (9.0), installed as ``flash_attn.cute`` for one test."""
    from harness.flash4_standin import Flash4Standin, installed

    with installed(Flash4Standin(allow_fp32=True, arch=90)) as standin:
        yield standin
