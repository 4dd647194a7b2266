"""One live trainer per run directory (the trainer holds it; a study's ``--force`` takes it before it
deletes one of its own runs, so it never deletes a run being trained).

Two trainers on one run dir would interleave their checkpoints and metrics: the second resumes from an
older step, moves the first one's newer checkpoints out of its lineage and writes the same steps again.
Rank 0 takes the run dir's lock before anything is written there (``hold``, called by ``entry.run``
before the trainer is built); the other ranks wait in one collective for rank 0's outcome, so none of
them starts work that writes before the lock is held, and a refusal stops the whole world with exit 2.

The lock is two files, both touched by rank 0 only (a cost that does not grow with the world):

* ``<run_dir>/run.lock``: an empty file, ``flock``ed while the trainer lives. The kernel releases it when
  the process dies, however it dies. It is never deleted (deleting a locked file lets a second process
  lock a new file of the same name).
* ``<run_dir>/run.lock.json``: who holds it (host, pid, Slurm job id and restart count, start time) and a
  heartbeat that a thread refreshes every ``HEARTBEAT_S``. This covers shared file systems where
  ``flock`` does not reach across nodes (or is not supported at all): a holder on another host counts as
  alive while its heartbeat is younger than ``STALE_AFTER_S``.

A holder that is gone is taken over, and the console says so: on this host, when the ``flock`` is free
(or, without ``flock``, when its pid is not running); a holder of the same Slurm job with another
restart count (a requeued job: Slurm ends an attempt before it starts the next); a holder whose
heartbeat is older than ``STALE_AFTER_S``. The record is created with ``link``, which fails where one
already exists, so two hosts that start at once cannot both claim a free run dir.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from .atomic import atomic_write_text, fsync_dir, temp_path_for

LOCK_NAME = "run.lock"
RECORD_NAME = "run.lock.json"
HEARTBEAT_S = 30.0  # how often the holder refreshes its heartbeat
STALE_AFTER_S = 300.0  # a holder on another host without a heartbeat for this long is gone
BUSY_WAIT_S = 10.0  # a free-looking lock held by a dead holder's children (DataLoader workers) for this long
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's answers for "someone holds it"


class RunDirError(Exception):
    """The run directory cannot be used: another trainer holds it, or it cannot be written."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): a pid reused by another process differs."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_running(pid: int, start_ticks: int | None = None) -> bool:
    """The process ``pid`` (started at ``start_ticks``, when known) runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    now = _start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


def _job() -> dict:
    env = os.environ
    return {
        "job_id": env.get("SLURM_JOB_ID") or None,
        "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0),
        "step_id": env.get("SLURM_STEP_ID") or None,
    }


def describe(record: dict | None, now: float | None = None) -> str:
    """The holder in words: host, pid, Slurm job, last heartbeat."""
    if not record:
        return "a holder that has not written its record yet"
    now = time.time() if now is None else now
    parts = [f"host {record.get('host')}", f"pid {record.get('pid')}"]
    if record.get("job_id"):
        parts.append(f"Slurm job {record['job_id']} (restart {record.get('restart_count', 0)})")
    beat = record.get("heartbeat")
    if isinstance(beat, (int, float)):
        parts.append(
            f"last heartbeat {now - beat:.0f} s ago ({time.strftime('%F %T', time.localtime(beat))})"
        )
    return ", ".join(parts)


def gone_because(record: dict, flocked: bool, now: float | None = None) -> str | None:
    """Why the holder of ``record`` is gone, or None while it may be alive.

    ``flocked``: this process holds ``run.lock``'s flock, which a live holder on this host would hold."""
    now = time.time() if now is None else now
    if record.get("host") == socket.gethostname():
        if record.get("boot_id") and record.get("boot_id") != _boot_id():
            return "this host restarted since"
        if flocked:
            return "its lock was free (the process ended)"
        if not pid_running(int(record.get("pid", 0)), record.get("pid_start")):
            return "its process is not running"
        return None
    job = _job()
    if job["job_id"] and record.get("job_id") == job["job_id"]:
        if record.get("restart_count", 0) != job["restart_count"]:
            return "an earlier attempt of this Slurm job (requeued)"
    beat = record.get("heartbeat")
    if not isinstance(beat, (int, float)) or now - beat > STALE_AFTER_S:
        return f"no heartbeat for more than {STALE_AFTER_S:.0f} s"
    return None


def read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class RunLock:
    """Rank 0's hold on a run directory (``acquire``, then ``release``)."""

    def __init__(self, run_dir: Path, log=print):
        self.run_dir = Path(run_dir)
        self.lock_path = self.run_dir / LOCK_NAME
        self.record_path = self.run_dir / RECORD_NAME
        self.log = log
        self.token = uuid.uuid4().hex
        self.record: dict = {}
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    # ---- taking it --------------------------------------------------------------------------------
    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunDirError`` naming the holder (or why the directory is unusable)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            flocked = self._flock()
            for _ in range(3):  # a claim that loses a race looks again
                if self._claim(flocked):  # writes a file: the directory takes files
                    break
            else:
                self._refuse(read_record(self.record_path))
        except OSError as e:
            self._unlock()
            raise RunDirError(
                f"run.dir={self.run_dir} cannot be written ({e.strerror or e}); fix: choose a directory you "
                "can write, e.g. run.dir=runs/<name>"
            ) from None
        except BaseException:
            self._unlock()
            raise
        self._thread = threading.Thread(target=self._beat, name="goat-run-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)  # also on an exit that skips the caller's release (an orphan's)
        return self

    def _flock(self) -> bool:
        """True: flocked; False: the file system has no flock (the record alone decides). A lock held by
        a holder that is gone from this host (its DataLoader workers may outlive it briefly) is awaited."""
        deadline = time.monotonic() + BUSY_WAIT_S
        assert self._fd is not None  # opened by acquire() first
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as e:
                if e.errno not in _HELD:
                    return False  # ENOLCK, EOPNOTSUPP, ENOSYS...: no flock here
            record = read_record(self.record_path)
            dead_here = (
                record is not None
                and record.get("host") == socket.gethostname()
                and not pid_running(int(record.get("pid", 0)), record.get("pid_start"))
            )
            if not dead_here or time.monotonic() > deadline:
                self._refuse(record, " (not running: a process it started still holds run.lock)" * dead_here)
            time.sleep(0.5)

    def _refuse(self, record: dict | None, note: str = "") -> None:
        raise RunDirError(
            f"run.dir={self.run_dir} is in use by another trainer: {describe(record)}{note} "
            f"({self.record_path}); "
            "fix: wait for that run to end (or stop it), or choose another run.dir. A holder that died is "
            f"taken over by the next start (at once on its host, elsewhere after {STALE_AFTER_S:.0f} s "
            "without a heartbeat)"
        )

    def _new_record(self) -> dict:
        now = time.time()
        pid = os.getpid()
        return {
            "host": socket.gethostname(),
            "pid": pid,
            "pid_start": _start_ticks(pid),
            "boot_id": _boot_id(),
            **_job(),
            "started": now,
            "heartbeat": now,
            "heartbeat_s": HEARTBEAT_S,
            "command": " ".join(sys.argv),
            "token": self.token,
        }

    def _claim(self, flocked: bool) -> bool:
        """Write our record where none is, or over a holder that is gone; False: lost a race, look again."""
        old = read_record(self.record_path)
        reason = None
        if old is not None:
            reason = gone_because(old, flocked)
            if reason is None:
                self._refuse(old)
        elif self.record_path.exists():  # unreadable: being written, or torn by a crash long ago
            try:
                age = time.time() - self.record_path.stat().st_mtime
            except OSError:
                return False
            if age < STALE_AFTER_S and not flocked:
                self._refuse(None)
            reason = "its record was unreadable"
        self.record = self._new_record()
        tmp = temp_path_for(self.record_path)
        try:
            tmp.write_text(json.dumps(self.record, indent=1))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            if self.record_path.exists() or old is not None:
                if not self._set_aside(old):
                    return False
            try:
                os.link(tmp, self.record_path)  # fails where another claim came first
            except FileExistsError:
                return False
            except OSError:  # no hard links on this file system: replace (flock and the heartbeat remain)
                os.replace(tmp, self.record_path)
            fsync_dir(self.run_dir)
        finally:
            tmp.unlink(missing_ok=True)
        if reason is not None:
            self.log(
                f"run.dir={self.run_dir}: took over the lock of a trainer that is gone ({reason}): "
                f"{describe(old)}"
            )
        return True

    def _set_aside(self, old: dict | None) -> bool:
        """Move the gone holder's record out of the way; False if what moved was a newer claim (put back)."""
        aside = self.record_path.with_name(f".{RECORD_NAME}.{self.token}.old")
        try:
            os.rename(self.record_path, aside)
        except FileNotFoundError:
            return True
        moved = read_record(aside)
        if old is not None and (moved or {}).get("token") != old.get("token"):
            try:
                os.link(aside, self.record_path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    # ---- holding it -------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.refresh()

    def refresh(self) -> None:
        """Renew the heartbeat, unless another trainer took the lock over (then say so, once)."""
        if self.lost:
            return
        current = read_record(self.record_path)
        if current is not None and current.get("token") != self.token:
            self.lost = True
            print(
                f"run.dir={self.run_dir}: the run lock was taken over by another trainer "
                f"({describe(current)}); this trainer's heartbeat stopped for too long (suspended?). "
                "Stop one of the two.",
                file=sys.stderr,
                flush=True,
            )
            return
        self.record["heartbeat"] = time.time()
        try:
            atomic_write_text(self.record_path, json.dumps(self.record, indent=1))
        except OSError:
            pass  # a passing file-system error; the next beat tries again

    # ---- letting go -------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop the heartbeat, remove our record (only ours), unlock. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self._fd is None:
            return
        if (read_record(self.record_path) or {}).get("token") == self.token:
            try:
                self.record_path.unlink()
            except OSError:
                pass
        self._unlock()

    def _unlock(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class WorldLock:
    """The run dir's lock as the world sees it: rank 0 holds a ``RunLock``; with more ranks, every rank
    learns in one collective whether rank 0 holds it before any rank goes on (``hold``)."""

    def __init__(self, cfg, log=print):
        self.cfg = cfg
        self.lock = RunLock(cfg.run_dir, log) if _rank() == 0 else None
        self.acquired = False  # rank 0: holds the lock
        self.agreed = False  # every rank: the world knows rank 0 holds it

    @property
    def held(self) -> bool:
        """This rank may write the run dir's records (rank 0 holds the lock, or told this rank so)."""
        return self.acquired if _rank() == 0 else self.agreed

    def hold(self) -> None:
        """Rank 0 takes the lock (and marks the attempt ``running`` in ``last_exit.json``); the other ranks
        wait for its outcome. Raises ``RunDirError`` on every rank when rank 0 could not take it; rank 0
        raises its own error (naming the holder), the others a short one (quiet: rank 0 speaks)."""
        error: BaseException | None = None
        if self.lock is not None:
            try:
                self._refuse_a_users_config()
                self.lock.acquire()
                self.acquired = True
                mark_running(self.cfg.run_dir, self.lock.record)
            except OSError as e:
                error = RunDirError(f"run.dir={self.cfg.run_dir} cannot be written ({e.strerror or e})")
            except BaseException as e:  # also an unexpected one: the other ranks must not wait for ever
                error = e
        if _world() > 1:
            try:
                refused = self._tell_the_world(error is not None)
            except BaseException:
                if error is not None:
                    raise error from None
                raise
            if refused and error is None:
                raise RunDirError(f"run.dir={self.cfg.run_dir}: rank 0 could not take the run lock")
        if error is not None:
            raise error
        self.agreed = True

    def _refuse_a_users_config(self) -> None:
        """Before anything is written: a config.yaml in the run dir that no run wrote stays the user's."""
        from .config import foreign_run_config

        theirs = foreign_run_config(Path(self.cfg.run_dir))
        if theirs is not None:
            raise RunDirError(
                f"{theirs} was not written by a goat-dist run, and the run would replace it with its "
                "resolved config (comments and 'auto' values lost): keep your config outside run.dir and "
                "pass it with --config from there, or set run.dir to another directory"
            )

    def _tell_the_world(self, refused: bool) -> bool:
        """One collective (the first of the run): rank 0's outcome to every rank."""
        import torch

        from . import collectives, distributed

        p = self.cfg.parallel
        # the groups' start: the start-up timeout, until the trainer's first step ends (parallel/timeouts.py)
        distributed.init(p.tp, p.cp, timeout_minutes=p.startup_timeout_minutes, run_dir=self.cfg.run_dir)
        flag = torch.tensor([1 if refused else 0])
        return bool(collectives.all_reduce(flag, op="max").item())

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def mark_running(run_dir: Path, holder: dict) -> None:
    """``last_exit.json`` says ``running`` from the start of an attempt until its end record replaces it:
    a record that still says so after the attempt was left by a process that was killed."""
    record = {
        "status": "running",
        "reason": None,
        "step": None,
        "exit_code": None,
        "time": holder.get("started", time.time()),
        **{k: holder.get(k) for k in ("started", "host", "pid", "job_id", "restart_count")},
    }
    atomic_write_text(Path(run_dir) / "last_exit.json", json.dumps(record, indent=1))
