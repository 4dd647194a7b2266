"""Every thread's Python stack, printed without risking the run: the step watchdog and ``SIGUSR2``.

A thread of this module prints the stacks (to fd 2, in faulthandler's layout: ``Thread 0x...
(most recent call first):``) when one step runs longer than ``hang_after_s`` (re-armed at every step
start, fired once per step) and whenever the process gets ``SIGUSR2`` (``kill -USR2 <pid>``,
``scancel --signal=USR2 <job>``). It reads the stacks with ``sys._current_frames()`` while holding the
GIL. ``faulthandler``'s watchdog reads other threads' frames without the GIL and can crash the process it
is meant to inspect (SIGSEGV while a thread starts or exits, CPython gh-116008; seen here when a step
outlived the watchdog): a slow but healthy step, or a user asking where a run is, must not end the run.

``SIGUSR2`` reaches this thread through ``signal.set_wakeup_fd``: the interpreter's C-level handler writes
the signal's number to a pipe at once, even while the main thread waits in a collective, and this thread
wakes on it. A process whose wakeup fd is already taken (an asyncio loop) prints on ``SIGUSR2`` from the
main thread instead, when it next runs Python. A thread that holds the GIL forever (stuck in C code that
never releases it) stops these prints too; ``py-spy dump --pid <pid>`` reads such a process from outside.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback

HANG_SIGNAL = signal.SIGUSR2  # print every thread's stack; the run goes on
STDERR_FD = 2  # the process's stderr, whatever a test harness put in sys.stderr
_WAKE = b"\0"  # a byte no signal number uses: the deadline moved, or stop
_WATCHES: set[StackWatch] = set()  # the started ones, forgotten in a forked child


def _ignore(signum, frame) -> None:
    """SIGUSR2's Python-level handler while the watch thread prints: nothing to do in the main thread."""


def _forget_watches_in_child() -> None:
    for watch in list(_WATCHES):
        watch._forget_in_child()


os.register_at_fork(after_in_child=_forget_watches_in_child)


def format_stacks(skip: int | None = None) -> str:
    """Every Python thread's stack but ``skip``'s (a thread id), most recent call first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        lines = [f'Thread 0x{ident:016x} "{names.get(ident, "?")}" (most recent call first):']
        for entry in reversed(traceback.extract_stack(frame)):
            lines.append(f'  File "{entry.filename}", line {entry.lineno} in {entry.name}')
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_all(fd: int, text: str) -> None:
    data = text.encode(errors="replace")
    while data:
        try:
            data = data[os.write(fd, data) :]
        except InterruptedError:
            continue
        except OSError:
            return  # stderr closed: nothing to print to, and the run must go on


class StackWatch:
    """The step watchdog and the ``SIGUSR2`` printer: ``start()`` in the main thread, ``arm()`` at each
    step start, ``stop()`` at the end (restores the previous handler and wakeup fd)."""

    def __init__(self, hang_after_s: float | None = None, fd: int = STDERR_FD):
        self.hang_after_s = hang_after_s
        self.fd = fd
        self.dumps = 0  # how many times the stacks were printed (for tests and logs)
        self._deadline: float | None = None
        self._armed_at = 0.0
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous_handler: signal._HANDLER = None
        self._previous_wakeup = -1

    def start(self) -> StackWatch:
        if self._pipe is not None:
            return self  # started already
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StackWatch.start() must run in the main thread (signal handlers live there)")
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C signal handler must never block
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if self._previous_wakeup != -1:  # someone else's wakeup fd: give it back, print from Python
            signal.set_wakeup_fd(self._previous_wakeup)
            self._previous_handler = signal.signal(HANG_SIGNAL, self._print_from_main)
        else:  # the C handler wakes the thread; the Python-level handler itself does nothing
            self._previous_handler = signal.signal(HANG_SIGNAL, _ignore)
        # a system call the signal interrupts restarts (SA_RESTART, as faulthandler.register had it): C code
        # that does not retry on EINTR (a store's or a socket's read) must not fail because stacks were asked
        signal.siginterrupt(HANG_SIGNAL, False)
        _WATCHES.add(self)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="goat-dist-stacks", daemon=True)
        self._thread.start()
        return self

    def arm(self) -> None:
        """Print the stacks once unless ``arm`` is called again within ``hang_after_s``."""
        if not self.hang_after_s or self._pipe is None:
            return
        with self._lock:
            idle = self._deadline is None
            self._armed_at = time.monotonic()
            self._deadline = self._armed_at + self.hang_after_s
        if idle:
            self._wake()

    def stop(self) -> None:
        if self._pipe is None:
            return
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._previous_wakeup == -1:
            current = signal.set_wakeup_fd(-1)
            if current != self._pipe[1]:  # set by someone else since start(): theirs stays
                signal.set_wakeup_fd(current)
        signal.signal(HANG_SIGNAL, self._previous_handler)
        self._close()

    def _close(self) -> None:
        _WATCHES.discard(self)
        for fd in self._pipe or ():
            os.close(fd)
        self._pipe, self._thread, self._deadline = None, None, None

    def _forget_in_child(self) -> None:
        """A forked child (a DataLoader worker) has no watch thread: it drops the inherited wakeup fd, so
        that a signal to the child does not wake a pipe only the parent reads."""
        if self._pipe is not None and self._previous_wakeup == -1:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass  # forked from a thread that is not the child's main one: the fd stays, unread
        self._close()

    def _wake(self) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe[1], _WAKE)
        except BlockingIOError:
            pass  # the pipe is full of unread bytes: the thread is awake anyway

    def _run(self) -> None:
        assert self._pipe is not None  # started by start(), after the pipe
        read_fd = self._pipe[0]
        while not self._stopping:
            with self._lock:
                deadline = self._deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([read_fd], [], [], timeout)
            except (OSError, ValueError):
                return  # the pipe was closed under it (a stop() that gave up waiting)
            if self._stopping:
                return
            if ready:
                if HANG_SIGNAL in os.read(read_fd, 512):
                    self._print("on SIGUSR2")
                continue
            with self._lock:
                fire = self._deadline is not None and time.monotonic() >= self._deadline
                if fire:
                    ran_s = time.monotonic() - self._armed_at
                    self._deadline = None  # once per step
            if fire:
                self._print(f"this step has run {ran_s:.3g} s (hang watchdog after {self.hang_after_s:g} s)")

    def _print(self, why: str) -> None:
        self.dumps += 1
        head = f"goat-dist: every thread's Python stack, {why}; the run goes on\n"
        watcher = self._thread.ident if self._thread is not None else None
        write_all(self.fd, head + format_stacks(skip=watcher))  # every thread but the watch's own

    def _print_from_main(self, signum, frame) -> None:
        self._print("on SIGUSR2")
