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
