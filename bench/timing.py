"""What the timing benchmarks share: the clock choice and the thread count, as command-line flags.

Imported by the scripts next to it (``python bench/<script>.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

import argparse
import time

import torch

CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def add_clock_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="process: CPU seconds of this process, steadier than wall time on a shared, loaded machine",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def seconds_per_call(fn, calls: int, clock=time.perf_counter) -> float:
    """Mean seconds of ``fn()`` over ``calls`` back-to-back calls, on ``clock``."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls
