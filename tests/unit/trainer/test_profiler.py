"""The profiler callback (``log.profile_steps``) driven through the loop's events by hand: the window on the
asked ranks only, a span per step, what a stop inside the window writes, nothing from a failing step.
A real 2-rank run's trace is checked in tests/integration/trainer/test_tensorboard.py."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from goat_dist.trainer.callbacks import Profiler


def profiler(tmp_path, steps, ranks=None, rank=0) -> Profiler:
    cfg = SimpleNamespace(log=SimpleNamespace(profile_steps=steps, profile_ranks=ranks))
    prof = Profiler(cfg)
    prof.trainer = SimpleNamespace(
        layout=SimpleNamespace(rank=rank, device=torch.device("cpu")), run_dir=tmp_path
    )
    return prof


def steps(prof: Profiler, state, count: int) -> None:
    for _ in range(count):
        prof.pre_step(state)
        torch.mm(torch.randn(32, 32), torch.randn(32, 32))
        state.step += 1
        prof.post_step(state, None)


def spans(path) -> list[str]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("goat-dist step"))


def test_the_window_is_traced_step_by_step(tmp_path):
    prof, state = profiler(tmp_path, [2, 3]), SimpleNamespace(step=0)
    steps(prof, state, 5)
    out = tmp_path / "profile" / "steps2-3"
    assert spans(out / "rank0.trace.json.gz") == ["goat-dist step 2", "goat-dist step 3"]
    assert "aten::mm" in (out / "rank0.top_ops.txt").read_text()
    assert prof.active is None and sorted(p.name for p in out.iterdir()) == [
        "rank0.top_ops.txt",
        "rank0.trace.json.gz",
    ]


def test_a_stop_inside_the_window_writes_what_was_traced(tmp_path):
    prof, state = profiler(tmp_path, [2, 10]), SimpleNamespace(step=0)
    steps(prof, state, 3)
    prof.on_stop(state, "SIGTERM")
    assert spans(tmp_path / "profile" / "steps2-10" / "rank0.trace.json.gz") == [
        "goat-dist step 2",
        "goat-dist step 3",
    ]


def test_a_failing_step_writes_nothing(tmp_path):
    prof, state = profiler(tmp_path, [1, 3]), SimpleNamespace(step=0)
    prof.pre_step(state)
    prof.on_error(state, RuntimeError("boom"))
    assert prof.active is None and not (tmp_path / "profile").exists()


@pytest.mark.parametrize("ranks,rank", [(None, 1), ([0, 2], 1)])
def test_ranks_not_asked_for_trace_nothing(tmp_path, ranks, rank):
    prof, state = profiler(tmp_path, [1, 2], ranks, rank), SimpleNamespace(step=0)
    steps(prof, state, 3)
    assert not (tmp_path / "profile").exists()  # default: rank 0 only
