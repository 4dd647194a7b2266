"""Preemption signals, honoured at step boundaries.

SIGTERM and SIGUSR1 (what Slurm sends before a preemption or time limit) and a first SIGINT only set a
flag; at the next step boundary all ranks agree (one all-reduce), save a checkpoint and exit with
``EXIT_CHECKPOINTED`` so that a job script can requeue. A second SIGINT aborts at once.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL: "try again", the run can continue from its latest checkpoint
_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1", signal.SIGINT: "SIGINT"}


class StopSignals:
    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def install(self) -> StopSignals:
        for sig in _NAMES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # second Ctrl-C: abort now
        self.received = self.received or _NAMES[signum]

    def agreed(self) -> str | None:
        """Collective: a reason to stop if any rank received a signal (each rank calls this every step)."""
        flag = torch.tensor([1 if self.received else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            return self.received or "signal on another rank"
        return None
