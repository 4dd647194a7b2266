"""Training every (run, seed) of a study in its own ``goat-dist train`` process, ``jobs`` at a time;
a finished run is reused only when it was trained with the same settings.

The study recognises the run directories it created by their ``study_run.json`` (``RECORD``), written
atomically into the run dir before its training starts (``status: training``) and again when it ends
(``finished``). A directory under ``out`` without one is not the study's: it is never trained into,
reused or deleted (``--force`` included), and the error names it. ``--force`` deletes only the study's
own run dirs, and none that a trainer holds (``run.lock``): it takes the run's lock, moves the
directory aside to a hidden sibling, lets the lock go and deletes the sibling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ...atomic import atomic_write_text, fsync_dir
from .spec import RECORD, StudyError


def seed_label(seed) -> str:
    return "config" if seed is None else str(seed)


def run_dir(study: dict, name: str, seed) -> Path:
    return study["out"] / name if seed is None else study["out"] / name / f"seed{seed}"


def finished(path: Path) -> bool:
    """The run's last process ended normally (``last_exit.json``) and left a checkpoint."""
    try:
        record = json.loads((path / "last_exit.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("status") == "finished" and (path / "checkpoints" / "latest").is_file()


def run_overrides(study: dict, name: str, seed) -> list[str]:
    """Every override of one (run, seed): shared, the run's, its seed; what a reused run must match."""
    seeded = [] if seed is None else [f"train.seed={seed}"]
    return [*study["overrides"], *study["runs"][name], *seeded]


def train_command(study: dict, name: str, seed=None) -> list[str]:
    config = ["--config", str(study["train_config"])] if study["train_config"] else []
    where = run_dir(study, name, seed)
    label = name if seed is None else f"{name}-seed{seed}"
    overrides = [*run_overrides(study, name, seed), f"run.dir={where}", f"run.name={label}"]
    return [sys.executable, "-m", "goat_dist", "train", *config, *overrides]


def run_record(study: dict, name: str, seed) -> dict:
    return {"train_config": str(study["train_config"]), "overrides": run_overrides(study, name, seed)}


def write_record(study: dict, name: str, seed, status: str) -> None:
    """The run dir's ``study_run.json`` (the study's mark on the directory), written atomically."""
    where = run_dir(study, name, seed)
    where.mkdir(parents=True, exist_ok=True)
    record = {**run_record(study, name, seed), "status": status, "time": time.time()}
    atomic_write_text(where / RECORD, json.dumps(record, indent=1))


def read_mark(where: Path) -> dict | str | None:
    """``where``'s ``study_run.json``: the record, "unreadable" (it exists, torn or not a record: written
    by an earlier study that crashed mid-write) or None (none, or ``where`` is no directory: the study did
    not create it)."""
    if not where.is_dir():
        return None
    path = where / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"
    return record if isinstance(record, dict) else "unreadable"


def check_reusable(study: dict, name: str, seed) -> None:
    """A run is reused or resumed only if the study created it and trained it with this study's settings
    (``study_run.json``); without a readable record it is refused, never reused unchecked."""
    where = run_dir(study, name, seed)
    record = read_mark(where)
    if record is None:
        raise StudyError(
            f"{where} exists, but this study did not create it (no {RECORD}): it neither trains into nor "
            "reuses a directory it did not write; move it away, or choose another 'out'"
        )
    if not isinstance(record, dict):
        raise StudyError(
            f"{where / RECORD} is unreadable: the settings {where} was trained with are unknown; "
            "rerun with --force to retrain it, or change 'out'"
        )
    want = run_record(study, name, seed)
    have = {key: record.get(key) for key in want}
    if have != want:
        raise StudyError(
            f"{where} was trained with other settings ({have}) than this study's ({want}); "
            "rerun with --force to retrain it, or change 'out'"
        )


def remove_own_run(where: Path) -> None:
    """``--force``: delete the run dir ``where`` if this study created it and no trainer holds it;
    otherwise raise ``StudyError`` naming it. The dir is moved aside (under its run lock) before it is
    deleted, so ``where`` is either whole or gone, and a trainer starting meanwhile finds the lock held."""
    from ...run_lock import RunDirError, RunLock

    why = "--force would delete"
    if where.is_symlink():
        raise StudyError(f"{why} {where}, a symbolic link (it deletes nothing through a link); move it away")
    if read_mark(where) is None:
        raise StudyError(
            f"{why} {where}, which this study did not create (no {RECORD}); move it away, or choose "
            "another 'out'"
        )
    lock = RunLock(where, log=lambda msg: print(f"[study] {msg}", flush=True))
    try:
        lock.acquire()
    except RunDirError as e:
        raise StudyError(f"--force does not delete {where}: {e}") from None
    aside = where.with_name(f".{where.name}.force-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(where, aside)
        fsync_dir(where.parent)
    except OSError as e:
        raise StudyError(f"{why} {where}, but it could not be moved aside ({e.strerror or e})") from None
    finally:
        lock.release()
    print(f"[study] --force: removing this study's run {where}", flush=True)
    try:
        shutil.rmtree(aside)
    except OSError as e:
        raise StudyError(
            f"--force moved {where} to {aside} but could not delete it ({e.strerror or e}); delete it by hand"
        ) from None


def claimable(where: Path) -> bool:
    """``where`` may be trained into without a record: it does not exist, or is an empty directory."""
    if not where.exists() and not where.is_symlink():
        return True
    return where.is_dir() and not any(where.iterdir())


def load_now() -> float:
    """The 1-minute load average: timings on a shared machine mean little without it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def pending_runs(study: dict, force: bool, seconds: dict, cpu: dict) -> list[tuple[str, object]]:
    """The (run, seed) pairs still to train, seed-major (a study cut short still has complete seeds);
    finished runs are checked against the study and counted as 0 s. ``force``: the study's own run dirs
    are deleted (``remove_own_run``); a directory the study did not create is refused, with or without."""
    todo = []
    for seed in study["seeds"]:
        for name in study["runs"]:
            where, label = run_dir(study, name, seed), seed_label(seed)
            if force and not claimable(where):
                remove_own_run(where)
            if not claimable(where):
                check_reusable(study, name, seed)  # the study's, with its settings: reuse or resume it
            if finished(where):
                print(f"[study] {name} seed {label}: reusing the finished run in {where}", flush=True)
                seconds[name][label] = cpu[name][label] = 0.0
            else:
                todo.append((name, seed))
    return todo


def start_run(study: dict, name: str, seed, loads: list) -> tuple[subprocess.Popen, float]:
    """One training process with ``study['threads']`` torch threads; with several jobs its output goes to
    ``<run_dir>/train.log`` (interleaved logs of parallel runs would be unreadable)."""
    from ...launcher import child_env

    where, label = run_dir(study, name, seed), seed_label(seed)
    loads.append(load_now())
    env = child_env(OMP_NUM_THREADS=str(study["threads"]))
    write_record(study, name, seed, "training")  # the study's mark, before anything else is written there
    out = None
    if study["jobs"] > 1:
        out = open(where / "train.log", "a")  # noqa: SIM115 (closed when the process ends)
    note = f", log {where / 'train.log'}" if out else ""
    print(f"[study] {name} seed {label}: training -> {where} (load {loads[-1]:.1f}{note})", flush=True)
    proc = subprocess.Popen(train_command(study, name, seed), env=env, stdout=out, stderr=out)
    proc.log = out
    return proc, time.perf_counter()


def train_all(study: dict, force: bool) -> dict:
    """Train every (run, seed) that has not finished, ``study['jobs']`` at a time: wall and CPU seconds
    per run (0: reused) and the load at each start. CPU seconds come from each child's own rusage."""
    seconds: dict[str, dict[str, float]] = {name: {} for name in study["runs"]}
    cpu: dict[str, dict[str, float]] = {name: {} for name in study["runs"]}
    loads: list[float] = []
    todo = pending_runs(study, force, seconds, cpu)
    running: dict[int, tuple] = {}
    while todo or running:
        while todo and len(running) < study["jobs"]:
            name, seed = todo.pop(0)
            proc, t0 = start_run(study, name, seed, loads)
            running[proc.pid] = (proc, name, seed, t0)
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        proc, name, seed, t0 = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.log:
            proc.log.close()
        label = seed_label(seed)
        if proc.returncode != 0:
            for other, *_ in running.values():
                other.terminate()
            where = run_dir(study, name, seed) / "train.log" if study["jobs"] > 1 else "its output above"
            raise RuntimeError(f"study run {name} seed {label} failed (exit {proc.returncode}); see {where}")
        write_record(study, name, seed, "finished")
        seconds[name][label] = time.perf_counter() - t0
        cpu[name][label] = usage.ru_utime + usage.ru_stime
        print(f"[study] {name} seed {label}: trained in {seconds[name][label] / 60:.1f} min", flush=True)
    return {"seconds": seconds, "cpu_s": cpu, "loads": loads}
