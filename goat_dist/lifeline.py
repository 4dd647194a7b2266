"""Workers die with their launcher.

A worker started by ``goat-dist train --nproc N``, ``torchrun`` or ``srun`` outlives a launcher killed
with SIGKILL: it would go on training and checkpointing into a run dir that a restarted job is about to
use. On Linux every such worker asks the kernel for ``ORPHAN_SIGNAL`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``; the parent of a torchrun worker is torchrun's process, that of an ``srun``
task is ``slurmstepd``) and then exits without saving anything: not SIGTERM, whose handler saves a
checkpoint. The kernel sends the signal when the parent *thread* that started the worker ends, which may
be before its process does, so the handler acts only once ``getppid()`` has changed.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
ORPHAN_SIGNAL = signal.SIGRTMIN + 4  # sent by nothing else; SIGTERM and SIGUSR1 mean "checkpoint and stop"
EXIT_ORPHANED = 1
LAUNCHER_PID_VAR = "GOAT_LAUNCHER_PID"  # set by launcher.run_world for its workers
EXIT_GRACE_S = 5.0  # for the atexit handlers (DataLoader workers, the run lock) before a hard exit

_parent: int | None = None


def watch_launcher() -> bool:
    """Exit (without saving) when this process's parent dies; True when the kernel will tell us.

    Called by a worker that a launcher started (``RANK`` set). ``GOAT_LAUNCHER_PID``, when set, is the
    parent the worker must have; otherwise the parent at the call. A parent that is already gone once the
    request is made (the race between fork and this call) ends the worker at once."""
    global _parent
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    expected = int(os.environ.get(LAUNCHER_PID_VAR) or 0) or os.getppid()
    _parent = expected
    signal.signal(ORPHAN_SIGNAL, _on_parent_death)
    if libc.prctl(PR_SET_PDEATHSIG, int(ORPHAN_SIGNAL), 0, 0, 0) != 0:
        return False
    if os.getppid() != expected:  # died before the request: no signal will come
        _exit_orphaned()
    return True


def _on_parent_death(signum, frame) -> None:
    if _parent is not None and os.getppid() == _parent:
        return  # the thread that started us ended, the launcher lives on
    _exit_orphaned()


def _exit_orphaned() -> None:
    """Leave now: no checkpoint, no exit record; the atexit handlers end helper processes and release the
    run lock, within ``EXIT_GRACE_S``."""
    rank = os.environ.get("RANK", "?")
    print(
        f"goat-dist: rank {rank}: its launcher (pid {_parent}) is gone; exiting without a checkpoint",
        file=sys.stderr,
        flush=True,
    )
    timer = threading.Timer(EXIT_GRACE_S, os._exit, (EXIT_ORPHANED,))
    timer.daemon = True
    timer.start()
    try:
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(EXIT_ORPHANED)
