"""Preemption signals, honoured at step boundaries.

SIGTERM and SIGUSR1 (what Slurm sends before a preemption or time limit) and a first SIGINT only set a
flag; the flag travels in the step's one collective (``control.agree``), so at the next step boundary
all ranks agree, save a checkpoint and exit with ``EXIT_CHECKPOINTED`` so that a job script can requeue.
A second SIGINT aborts at once.
"""

from __future__ import annotations

import signal

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
