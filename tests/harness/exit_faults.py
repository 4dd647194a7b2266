"""A fault at a run's very end, for the Slurm tests: the moment between the last collective and rank 0's
``last_exit.json`` is made long, and a step's SIGTERM ends the process at once, as it does wherever
nothing set it to "ignore" (``goat_slurm.py exec`` does; a site's own wrapper may not).

``train.callbacks=[harness.exit_faults:SlowExitRecord:5]`` with ``tests/`` on the child's ``PYTHONPATH``
(``harness.faults.fault_env``). Were the record written after the final barrier, a rank that left the
barrier and exited 75 would make ``srun --kill-on-bad-exit=1`` end rank 0 before its record, and the
attempt would count as failed."""

from __future__ import annotations

import os
import signal
import time

from goat_dist.trainer.callbacks import Callback


class SlowExitRecord(Callback):
    """After training (signal handlers restored): SIGTERM to its default action, and rank 0's write of
    ``last_exit.json`` delayed by ``delay_s`` seconds."""

    def __init__(self, delay_s):
        self.delay_s = float(delay_s)

    def on_train_end(self, state) -> None:
        from goat_dist.trainer import entry

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.environ.get("RANK", "0") != "0":
            return
        write = entry.atomic_write_text

        def slow_write(path, text):
            time.sleep(self.delay_s)
            write(path, text)

        entry.atomic_write_text = slow_write
