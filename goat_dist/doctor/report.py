"""The doctor's report: the checks in their order, each rank's ok/warn/FAIL lines, and the failure mask
the ranks agree on (one bit per check)."""

from __future__ import annotations

import sys

CHECKS = ("devices", "rendezvous", "all-reduce", "run dir", "data", "disk", "write", "rehearsal")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class Report:
    def __init__(self, rank: int, host: str):
        self.rank, self.host = rank, host
        self.failed: set[str] = set()
        self.lines: list[str] = []  # rank 0's ok lines, printed in the summary
        self.bandwidth: dict | None = None  # the all-reduce measurement

    def ok(self, check: str, text: str) -> None:
        self.lines.append(f"  ok    {check}: {text}")

    def warn(self, check: str, text: str) -> None:
        self.lines.append(f"  warn  {check}: {text}")

    def fail(self, check: str, text: str) -> None:
        self.failed.add(check)
        print(f"goat-dist doctor: FAIL {check}: {text} [rank {self.rank} on {self.host}]", file=sys.stderr)
        sys.stderr.flush()

    def mask(self) -> int:
        return sum(1 << i for i, c in enumerate(CHECKS) if c in self.failed)
