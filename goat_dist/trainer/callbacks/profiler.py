"""``torch.profiler`` over a window of steps (``log.profile_steps: [first, last]``) on the ranks asked for
(``log.profile_ranks``, default rank 0 only: at 512 ranks, 512 traces of a GPU step are tens of GB on a
shared file system; list the ranks to compare, one per TP/PP stage say).

Each profiled rank writes ``<run_dir>/profile/steps<first>-<last>/rank<r>.trace.json.gz`` (a Chrome trace:
open it in https://ui.perfetto.dev or ``chrome://tracing``; CPU ops, and CUDA kernels on a GPU) and
``rank<r>.top_ops.txt`` (the ops by self time, ``key_averages``), each written to a temporary name and
renamed. The trace starts before the first step's data and ends after the last step's optimizer update,
before that step's logging, evaluation and checkpoint (this callback runs first); each step is a span
named ``goat-dist step N``. A run stopped inside
the window writes what it traced. No collective: a rank that profiles and one that does not take the same
steps through the same collectives.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import Callback

TOP_OPS = 30  # rows of the op table


class Profiler(Callback):
    order = 5  # before the other jobs: the trace holds the step, not its logging or checkpoint

    def __init__(self, cfg):
        self.window = tuple(cfg.log.profile_steps) if cfg.log.profile_steps else None
        self.ranks = set(cfg.log.profile_ranks if cfg.log.profile_ranks is not None else [0])
        self.active: Any = None  # the running torch.profiler.profile
        self.span: Any = None  # the running step's record_function
        self.written: list[Path] = []

    def pre_step(self, state):
        if self.active is None and self._starts(state.step + 1):
            self._start()
        if self.active is not None:  # each step a named span in the trace: "goat-dist step N"
            from torch.profiler import record_function

            self.span = record_function(f"goat-dist step {state.step + 1}")
            self.span.__enter__()

    def _starts(self, step: int) -> bool:
        """This rank traces from ``step`` on: in the window (a resume inside it traces the rest)."""
        if self.window is None or self.trainer.layout.rank not in self.ranks:
            return False
        return self.window[0] <= step <= self.window[1]

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.trainer.layout.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.active = profile(activities=activities, record_shapes=True)
        self.active.start()

    def post_step(self, state, control):
        self._end_span()
        if self.active is not None and self.window is not None and state.step >= self.window[1]:
            self._finish()

    def _end_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def on_stop(self, state, reason):
        if self.active is not None:
            self._finish()

    def on_error(self, state, error):
        self._end_span()
        if self.active is not None:
            self.active.stop()  # nothing written: the trace of a failing step is no measurement
            self.active = None

    def _finish(self) -> None:
        prof, self.active = self.active, None
        assert prof is not None and self.window is not None  # called while a trace runs
        prof.stop()
        first, last = self.window
        rank = self.trainer.layout.rank
        out = Path(self.trainer.run_dir) / "profile" / f"steps{first}-{last}"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"rank{rank}.trace.json.gz"
        tmp = out / f".rank{rank}.{os.getpid()}.tmp.json.gz"  # export gzips by the ".gz" ending
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        sort = (
            "self_cuda_time_total"
            if any(a.name == "CUDA" for a in prof.activities)
            else "self_cpu_time_total"
        )
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS)
        from ...atomic import atomic_write_text

        ops = out / f"rank{rank}.top_ops.txt"
        atomic_write_text(ops, f"rank {rank}, steps {first}-{last}, by {sort}\n{table}\n")
        self.written += [trace, ops]
        print(f"profile: rank {rank}, steps {first}-{last} -> {trace} (top ops: {ops})", flush=True)
