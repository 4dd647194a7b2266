"""A full disk during one checkpoint save, on one rank, for real ``goat-dist train`` runs:
``train.callbacks=[harness.disk_faults:DiskFullAt:4:1]`` makes rank 1's write of step 4's state file fail
with ENOSPC (``tests/`` on the child's ``PYTHONPATH``: ``harness.faults.fault_env``)."""

from __future__ import annotations

import errno
from pathlib import Path

from goat_dist.checkpoint import tensor_file
from goat_dist.checkpoint.names import tag_for
from goat_dist.trainer.callbacks import Callback


class DiskFullAt(Callback):
    """ENOSPC from rank ``rank``'s write of its ``universal/`` file of step ``step``."""

    def __init__(self, step, rank=0):
        self.tag, self.rank = tag_for(int(step)), int(rank)

    patched = False

    def attach(self, trainer):  # called again whenever a callback is added: patch once
        super().attach(trainer)
        if trainer.layout.rank != self.rank or self.patched:
            return
        self.patched = True
        real, tag = tensor_file._write, self.tag

        def write(path, head, entries):
            if Path(path).parent.parent.name == tag:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, head, entries)

        tensor_file._write = write
