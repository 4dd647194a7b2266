"""Preemption signals, honoured at step boundaries.

SIGTERM and SIGUSR1 (what Slurm sends before a preemption or time limit) and a first SIGINT only set a
flag; the flag travels in the step's one collective (``control.agree``), so at the next step boundary
all ranks agree and save a checkpoint; ``last_exit.json`` then carries ``EXIT_CHECKPOINTED`` so that a
job script can requeue, and rank 0 exits with it (the other ranks exit 0: ``entry.process_exit_code``).
A second SIGINT aborts at once (``EXIT_ABORTED``).

Hangs: while installed, every thread's Python stack goes to stderr when one step runs longer than
``hang_after_s`` (a watchdog re-armed at every step start), and on SIGUSR2 at any time (``scancel
--signal=USR2 <job>``, ``kill -USR2 <pid>``); ``trainer/stacks.py`` prints them without risking the run. A
rank waiting in a collective prints its stacks before the collective's timeout ends the job: the trainer
sets ``hang_after_s`` from ``parallel.startup_timeout_minutes`` until its first step ends, then from
``parallel.timeout_minutes`` (``set_hang_after``; ``goat_dist/parallel/timeouts.py``).
"""

from __future__ import annotations

import signal

from goat_dist.trainer.stacks import StackWatch

EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL: "try again", the run can continue from its latest checkpoint
EXIT_ABORTED = 130  # 128 + SIGINT, as a shell reports it: a second Ctrl-C, no checkpoint of that step
_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1", signal.SIGINT: "SIGINT"}
HANG_FRACTION = 0.9  # of the collective timeout: the stacks come out before the timeout's error


class StopSignals:
    def __init__(self, hang_after_s: float | None = None):
        self.received: str | None = None
        self.stacks = StackWatch(hang_after_s)
        self._previous = {}

    def install(self) -> StopSignals:
        for sig in _NAMES:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.stacks.start()
        return self

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def hang_after_s(self) -> float | None:
        return self.stacks.hang_after_s

    def set_hang_after(self, seconds: float | None) -> None:
        """The watchdog's threshold from now on: the rest of the step under way is watched for ``seconds``
        from now, each later step from its start. The watch thread sleeps towards the deadline it was last
        woken for, and ``arm`` wakes it only when idle (a later deadline needs no wake): the pending deadline
        is dropped first, so a shorter threshold wakes it too."""
        watch = self.stacks
        watch.hang_after_s = seconds
        with watch._lock:
            watch._deadline = None
        watch.arm()

    def step_started(self) -> None:
        """Re-arm the hang watchdog: stacks to stderr unless the next step starts within hang_after_s."""
        self.stacks.arm()

    def uninstall(self) -> None:
        self.stacks.stop()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # second Ctrl-C: abort now
        self.received = self.received or _NAMES[signum]
