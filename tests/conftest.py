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


@pytest.fixture
def fa4():
    """The FlashAttention-4 stand-in (tests/harness/flash4_standin.py), fp32 allowed (exact comparisons),
    playing an H100/H200 (9.0), installed as ``flash_attn.cute`` for one test."""
    from harness.flash4_standin import Flash4Standin, installed

    with installed(Flash4Standin(allow_fp32=True, arch=90)) as standin:
        yield standin
