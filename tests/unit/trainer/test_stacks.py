"""The step watchdog and SIGUSR2 print every thread's stack and the run goes on (trainer/stacks.py).

Each check runs in its own interpreter: it installs signal handlers and a wakeup fd, and a crash must show
as that process's exit status, not end the test session.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STACKS = ROOT / "goat_dist" / "trainer" / "stacks.py"
HEADER = "goat-dist: every thread's Python stack"


def run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # the module alone (it needs only the standard library): no torch import per check
    script = "import importlib.util, os, signal, sys, threading, time\n"
    script += f"spec = importlib.util.spec_from_file_location('stacks', {str(STACKS)!r})\n"
    script += "stacks = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(stacks)\n"
    script += "StackWatch = stacks.StackWatch\n"
    script += textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_a_step_that_outlives_the_watchdog_prints_every_stack_once():
    done = run(
        """
        watch = StackWatch(hang_after_s=0.3).start()
        worker = threading.Thread(target=lambda: time.sleep(1.5), name="data-worker")
        worker.start()
        def a_slow_step():
            time.sleep(1.2)
        watch.arm()
        a_slow_step()
        watch.stop()
        worker.join()
        print("dumps", watch.dumps)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dumps", "1"], done.stdout  # once per step, not repeated
    assert done.stderr.count(HEADER) == 1, done.stderr
    assert "this step has run" in done.stderr and "(hang watchdog after 0.3 s)" in done.stderr
    main = done.stderr.split('"MainThread" (most recent call first):')[1].split("\n\n")[0]
    assert "in a_slow_step" in main.splitlines()[1], main  # the innermost Python frame comes first
    assert '"data-worker" (most recent call first)' in done.stderr  # every thread, not only main
    assert "goat-dist-stacks" not in done.stderr  # not the printing thread itself


def test_steps_that_start_within_the_limit_print_nothing():
    done = run(
        """
        watch = StackWatch(hang_after_s=2.0).start()
        for _ in range(12):
            watch.arm()
            time.sleep(0.1)
        watch.stop()
        print("dumps", watch.dumps)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dumps", "0"] and HEADER not in done.stderr, done.stderr


def test_sigusr2_prints_while_the_main_thread_waits_in_a_system_call():
    """The main thread is blocked in read(2) throughout (as a rank waits in a collective): the stacks come
    from the watch's thread, woken by the interpreter's C-level handler through the wakeup fd."""
    done = run(
        """
        watch = StackWatch(hang_after_s=None).start()
        r, w = os.pipe()
        def poke():
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(1.0)
            os.write(w, b"x")
        threading.Thread(target=poke).start()
        def waiting_in_a_collective():
            return os.read(r, 1)
        waiting_in_a_collective()
        watch.stop()
        default = signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        print("dumps", watch.dumps, "wakeup", signal.set_wakeup_fd(-1), default)
        """
    )
    assert done.returncode == 0, done.stderr
    assert HEADER + ", on SIGUSR2" in done.stderr, done.stderr
    main = done.stderr.split('"MainThread" (most recent call first):')[1].split("\n\n")[0]
    assert "in waiting_in_a_collective" in main, main  # printed while main was still in read(2)
    # stop() gave back what was there: no wakeup fd, the default SIGUSR2 action
    assert done.stdout.split() == ["dumps", "1", "wakeup", "-1", "True"], done.stdout


def test_sigusr2_prints_from_the_main_thread_where_the_wakeup_fd_is_taken():
    done = run(
        """
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)  # an asyncio loop's, say
        watch = StackWatch(hang_after_s=None).start()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        watch.stop()
        print("dumps", watch.dumps, "kept", signal.set_wakeup_fd(-1) == w)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["dumps", "1", "kept", "True"], done.stdout
    assert HEADER + ", on SIGUSR2" in done.stderr
    assert '"MainThread" (most recent call first)' in done.stderr, done.stderr  # printed from main, with it


def test_sigusr2_restarts_the_system_call_it_interrupts():
    """C code blocked in read(2) that does not retry on EINTR (a store's socket, a collective's) must not
    fail because someone asked for the stacks: the handler is installed with SA_RESTART."""
    done = run(
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        watch = StackWatch(hang_after_s=None, fd=os.open(os.devnull, os.O_WRONLY)).start()
        r, w = os.pipe()
        def poke():
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.5)
            os.write(w, b"x")
        threading.Thread(target=poke).start()
        got = libc.read(r, ctypes.create_string_buffer(1), 1)  # no EINTR retry of its own
        time.sleep(0.3)
        watch.stop()
        print("read", got, "errno", ctypes.get_errno() if got < 0 else 0, "dumps", watch.dumps)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["read", "1", "errno", "0", "dumps", "1"], done.stdout


def test_start_twice_is_one_watch_and_stop_gives_everything_back():
    done = run(
        """
        before = set(os.listdir("/proc/self/fd"))
        watch = StackWatch(hang_after_s=None).start()
        watch.start()
        threads = sorted(t.name for t in threading.enumerate())
        watch.stop()
        after = set(os.listdir("/proc/self/fd"))
        default = signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        print(threads, signal.set_wakeup_fd(-1), default, sorted(after - before))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['MainThread', 'goat-dist-stacks'] -1 True []", done.stdout


def test_a_forked_child_drops_the_inherited_wakeup_fd():
    """A DataLoader worker forked while the watch runs: its signals must not wake the parent's pipe (the
    parent would print its own stacks for a signal sent to the child)."""
    done = run(
        """
        watch = StackWatch(hang_after_s=None).start()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 3)
        _, status = os.waitpid(pid, 0)
        watch.stop()
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "0"], done.stdout


def test_printing_while_threads_start_and_exit_does_not_crash_the_process():
    """faulthandler's watchdog, which read other threads' frames without the GIL, crashed a process like
    this one with SIGSEGV (about one 20 s run in three on Python 3.11); the watch must survive it. Each
    "step" runs Python frames until the watch has printed once, so the count does not depend on speed."""
    done = run(
        """
        stop = False
        def churn():
            while not stop:
                t = threading.Thread(target=lambda: sum(range(100)))
                t.start()
                t.join()
        def deep(n):
            return n if n == 0 else deep(n - 1) + 0
        threading.Thread(target=churn, daemon=True).start()
        watch = StackWatch(hang_after_s=0.001, fd=os.open(os.devnull, os.O_WRONLY)).start()
        t0 = time.monotonic()
        while watch.dumps < 200 and time.monotonic() - t0 < 60:
            seen = watch.dumps
            watch.arm()
            while watch.dumps == seen and time.monotonic() - t0 < 60:
                deep(30)
        stop = True
        watch.stop()
        print("dumps", watch.dumps)
        """,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["dumps", "200"], done.stdout


def test_the_package_leaves_faulthandler_watchdogs_alone():
    """faulthandler's dump_traceback_later and register() print from outside the GIL; the package uses
    trainer/stacks.py instead (faulthandler.enable, which prints only on a fatal signal, is allowed)."""
    banned = {"dump_traceback_later", "register", "dump_traceback"}
    found, calls = [], 0
    for path in (ROOT / "goat_dist").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                calls += node.value.id == "signal"
                if node.value.id == "faulthandler" and node.attr in banned:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} faulthandler.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "faulthandler":
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno} from faulthandler import {a.name}"
                    for a in node.names
                    if a.name in banned
                ]
    assert calls > 0  # the scan sees attribute uses at all
    assert not found, found
