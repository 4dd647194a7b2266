import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", module="megatron")

# pytest-xdist (pyproject's addopts: ``-n auto --dist loadfile --no-loadscope-reorder``) runs the suite in a
# few worker processes: a test that launches processes leaves a core idle while they import or wait. A
# worker takes a whole group of tests at a time: a file, or the files SHARED_GROUPS joins because they share
# an expensive session fixture. So a module or session fixture trains its run once, and tests that must not
# overlap (one private Slurm cluster, fixed ports) run one after the other on one worker. (xdist's own
# ``xdist_group`` mark is not used: xdist 3.8 marks a group by rewriting ``item._nodeid``, which pytest 9.2
# no longer reads, so such groups split silently.)
ROOT = Path(__file__).resolve().parent.parent
MAX_WORKERS = 2
SHARED_GROUPS = {
    # the layouts' 2- and 4-rank launches and references (tests/integration/parallel/conftest.py)
    "tests/integration/parallel/test_scale_out.py": "parallel-layouts",
    "tests/integration/parallel/test_context_parallel_runs.py": "parallel-layouts",
}
# The groups that take longest start first, so that none of them is left running alone at the end; the
# others follow in file order (tests/unit's many short files last). Seconds measured on 2 cores, cold.
LONGEST_FIRST = (
    "tests/integration/checkpoint/test_checkpoint.py",  # ~290 s: ~40 launches of 1-4 processes
    "tests/integration/kernels/test_fa4_compile.py",  # ~240 s: two processes compiling FA4's kernels
    "tests/integration/slurm/test_slurm.py",  # ~170 s: jobs on a private Slurm cluster
    "parallel-layouts",  # ~90 s: tests/integration/parallel/, a 2-rank and a 4-rank launch
    "tests/integration/core/test_hangs.py",  # ~70 s, most of it waiting for a collective's timeout
)


def group_of(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or the shared group its file is in."""
    path = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(path, path)


class XdistHooks:
    """pytest-xdist's hooks, registered only where xdist is (``-p no:xdist`` and a bare pytest work too:
    ``bench/gpu_suite.sh`` runs tests/gpu in one process)."""

    @staticmethod
    def pytest_xdist_auto_num_workers(config):
        """``-n auto``: one worker per core, at most MAX_WORKERS (the multi-process tests start 2-4
        processes each; more workers only oversubscribe the cores). ``-n N`` overrides it."""
        return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """Whole groups (``group_of``) to one worker each, in the order of the collection."""
        from xdist.scheduler import LoadScopeScheduling

        class GroupScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return GroupScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(), "goat-dist-xdist-hooks")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: file order otherwise


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
