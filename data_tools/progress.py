"""`prepare`'s progress: a tqdm bar on a terminal, plain lines anywhere else.

Why: a bar redraws itself with carriage returns, which a log file (Slurm's, `2> prepare.log`) keeps as
one ever-growing line. Where the bar's stream (stderr) is no terminal, `LineProgress` writes a plain
line each time another `STEP_PERCENT` of the input is read, or, when the input's size is unknown
(compressed, Parquet or Arrow inputs), every `INTERVAL_S` seconds.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

STEP_PERCENT = 10
INTERVAL_S = 60.0


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class LineProgress:
    """tqdm's `update` / `set_postfix` as plain lines on `stream`; one at most per `STEP_PERCENT` of
    `total` bytes (or per `interval_s` without a total)."""

    def __init__(
        self, total: int | None, stream: TextIO, desc: str = "prepare", interval_s: float = INTERVAL_S
    ):
        self.total, self.stream, self.desc, self.interval_s = total, stream, desc, interval_s
        self.n = 0
        self.postfix: dict = {}
        self.shown = 0  # the last multiple of STEP_PERCENT written (with a total)
        self.last = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def set_postfix(self, refresh: bool = True, **postfix) -> None:
        self.postfix = postfix

    def update(self, n: int) -> None:
        self.n += n
        if self.total:
            step = min(100, self.n * 100 // self.total) // STEP_PERCENT * STEP_PERCENT
            if step > self.shown:
                self.shown = step
                self._line(f"{step}% ({_size(self.n)} of {_size(self.total)})")
        elif time.monotonic() - self.last >= self.interval_s:
            self.last = time.monotonic()
            self._line(f"{_size(self.n)} read")

    def _line(self, where: str) -> None:
        extra = "".join(
            f", {v:,} {k}" if isinstance(v, int) else f", {k}={v}" for k, v in self.postfix.items()
        )
        print(f"[data] {self.desc}: {where}{extra}", file=self.stream, flush=True)


def progress_bar(total: int | None, show: bool, stream: TextIO | None = None, desc: str = "prepare"):
    """A tqdm bar when `show` and `stream` (default: stderr, tqdm's) is a terminal; plain lines when
    `show` and it is not; nothing when not `show`."""
    stream = sys.stderr if stream is None else stream
    if show and not getattr(stream, "isatty", lambda: False)():
        return LineProgress(total, stream, desc)
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show, file=stream)
