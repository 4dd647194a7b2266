"""Training every (run, seed) of a study in its own ``goat-dist train`` process, ``jobs`` at a time;
a finished run is reused only when it was trained with the same settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def check_reusable(study: dict, name: str, seed) -> None:
    """A finished run is reused only if it was trained with this study's settings (``study_run.json``)."""
    where = run_dir(study, name, seed)
    try:
        record = json.loads((where / RECORD).read_text())
    except (OSError, ValueError):
        print(f"[study] {name}: {where} has no {RECORD}; reusing it unchecked", flush=True)
        return
    want = run_record(study, name, seed)
    if record != want:
        raise StudyError(
            f"{where} was trained with other settings ({record}) than this study's ({want}); "
            "rerun with --force to retrain it, or change 'out'"
        )


def load_now() -> float:
    """The 1-minute load average: timings on a shared machine mean little without it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def pending_runs(study: dict, force: bool, seconds: dict, cpu: dict) -> list[tuple[str, object]]:
    """The (run, seed) pairs still to train, seed-major (a study cut short still has complete seeds);
    finished runs are checked against the study and counted as 0 s."""
    todo = []
    for seed in study["seeds"]:
        for name in study["runs"]:
            where, label = run_dir(study, name, seed), seed_label(seed)
            if force and where.exists():
                shutil.rmtree(where)
            if finished(where):
                check_reusable(study, name, seed)
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
    out = None
    if study["jobs"] > 1:
        where.mkdir(parents=True, exist_ok=True)
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
        (run_dir(study, name, seed) / RECORD).write_text(json.dumps(run_record(study, name, seed), indent=1))
        seconds[name][label] = time.perf_counter() - t0
        cpu[name][label] = usage.ru_utime + usage.ru_stime
        print(f"[study] {name} seed {label}: trained in {seconds[name][label] / 60:.1f} min", flush=True)
    return {"seconds": seconds, "cpu_s": cpu, "loads": loads}
