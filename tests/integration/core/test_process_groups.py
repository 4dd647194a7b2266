"""Process groups that scale: at 512 ranks a CUDA run holds no gloo mesh (every group NCCL only, whose
communicators connect a few peers each), and sets NCCL's error handling and flight recorder. No GPU
here: the world is torch's fake process group on a simulated CUDA machine (tests/workers/fake_world.py)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from harness.multiproc import ROOT, marked_line

from goat_dist import distributed


@pytest.fixture(scope="module")
def world512(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run512")
    worker = str(ROOT / "tests" / "workers" / "fake_world.py")
    return json.loads(marked_line([worker, "512", "8", str(run_dir)], "FAKE_WORLD")), run_dir


def test_512_ranks_hold_no_gloo_group(world512):
    """megatron's layout at TP=8 x DP=64 is ~3,000 groups; under "cpu:gloo,cuda:nccl" for all of them
    (and megatron's own gloo groups) every one was a gloo mesh: thousands of sockets per process. A gloo
    side on the world alone still cost each rank 511 sockets at start (bench/world_sockets.py)."""
    info, _ = world512
    assert (info["world"], info["tp"], info["dp"]) == (512, 8, 64)
    backends = info["backends"]
    assert len(backends) > 1000  # the groups megatron creates were all seen
    gloo = [b for b in backends if "gloo" in b]
    assert not gloo, (
        f"{len(gloo)} of {len(backends)} groups have a gloo side, the world's first: {backends[0]}"
    )
    assert set(backends) == {"nccl"}


def test_cuda_run_sets_nccl_error_handling_and_flight_recorder(world512):
    info, run_dir = world512
    env = info["env"]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("1", "3")  # a timed-out collective ends the process
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(run_dir / distributed.NCCL_TRACE_PREFIX)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # TP=8: megatron's TP overlap


def test_cpu_keeps_gloo_for_every_group(world1):
    assert distributed.backend_for(False) == "gloo"
    assert dist.get_backend() == "gloo"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in distributed.cuda_environment(1, None)
