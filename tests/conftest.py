import os
import warnings

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", module="megatron")


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
