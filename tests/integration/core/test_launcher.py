"""Launching and ending worlds.

Child processes start clean: no parent world's launcher variables, and DeepSpeed told the machine's
accelerator (cuda where a GPU is visible: a CUDA child told "cpu" would build a CPU engine). Workers die
with their launcher, saving nothing (``lifeline``). ``goat-dist train --nproc N`` passes a usage error's
exit 2 on, stops with a checkpoint and exit 75 on Ctrl-C, and one run dir has one live trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness.multiproc import ROOT, TINY, clean_env, records

from goat_dist.launcher import child_env
from goat_dist.run_lock import pid_running


def test_child_env_drops_launcher_variables_and_names_the_accelerator(monkeypatch):
    base = {"RANK": "3", "MASTER_PORT": "29500", "PATH": "/bin"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert child_env(base) == {"PATH": "/bin", "DS_ACCELERATOR": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert child_env(base)["DS_ACCELERATOR"] == "cuda"
    assert child_env({**base, "DS_ACCELERATOR": "cpu"})["DS_ACCELERATOR"] == "cpu"  # an explicit choice wins


WORKER = "import os, sys; sys.exit({other} if int(os.environ['RANK']) else {rank0})"


def test_world_passes_a_usage_error_on_without_torchruns_report(tmp_path):
    """``run_world`` (``goat-dist train --nproc``): rank 0's exit 2 is the world's, with no ChildFailedError
    report; any other failure is exit 1 in one line."""
    import subprocess
    import sys

    def world(rank0: int, other: int):
        code = (
            "import sys; from goat_dist.launcher import run_world; "
            f"sys.exit(run_world(2, ['-c', {WORKER.format(rank0=rank0, other=other)!r}]))"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    usage = world(2, 0)
    assert (
        usage.returncode == 2 and "ChildFailedError" not in usage.stderr and "Traceback" not in usage.stderr
    )
    crash = world(3, 0)
    assert crash.returncode == 1 and "rank 0 of 2 failed with exit code 3" in crash.stderr
    assert world(0, 0).returncode == 0
    aborted = world(130, 0)  # a second Ctrl-C
    assert aborted.returncode == 130 and aborted.stderr == ""


def test_a_second_ctrl_c_aborts_with_130_and_one_line(tmp_path, monkeypatch, capsys):
    """``goat-dist train``: the trainer's second SIGINT raises KeyboardInterrupt; the command says so in
    one line (no traceback) and exits 130, as a shell reports an interrupted command; ``last_exit.json``
    records the same code (``entry.exit_code_for``)."""
    from goat_dist import cli, distributed
    from goat_dist.trainer import entry

    def interrupted(cfg):
        raise KeyboardInterrupt

    def exit_process(code):
        raise SystemExit(code)

    monkeypatch.setattr("goat_dist.trainer.run", interrupted)
    monkeypatch.setattr(distributed, "exit_process", exit_process)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as ended:
        cli.main(["train", f"run.dir={tmp_path / 'run'}"])
    assert ended.value.code == 130 and entry.exit_code_for(KeyboardInterrupt()) == 130
    err = capsys.readouterr().err
    assert err.strip() == "goat-dist train: aborted (a second Ctrl-C): no checkpoint of this step"


# a worker that watches its launcher (what `goat-dist train` does first under a launcher), then idles
WATCHER = (
    "import os, time; from goat_dist.lifeline import watch_launcher; watch_launcher(); "
    "print('watching', os.getpid(), flush=True); time.sleep(300)"
)
# its launcher: started from a thread that ends 2 s later (PR_SET_PDEATHSIG fires then), then idles
LAUNCHER = (
    "import subprocess, sys, threading, time; "
    f"start = lambda: subprocess.Popen([sys.executable, '-c', {WATCHER!r}]) and time.sleep(2); "
    "t = threading.Thread(target=start); t.start(); t.join(); print('thread ended', flush=True); "
    "time.sleep(300)"
)


def gone_within(pids: list[int], seconds: float) -> float:
    """Seconds until none of ``pids`` runs (a zombie counts as gone); fails after ``seconds``."""
    start = time.monotonic()
    while any(pid_running(pid) for pid in pids):
        assert time.monotonic() - start < seconds, f"still running after {seconds} s: {pids}"
        time.sleep(0.1)
    return time.monotonic() - start


def watching_pids(proc: subprocess.Popen, count: int) -> list[int]:
    pids = []
    while len(pids) < count:
        line = proc.stdout.readline()
        assert line, "the launcher ended before its workers watched it"
        if line.startswith("watching"):
            pids.append(int(line.split()[1]))
    return pids


def test_a_worker_outlives_the_thread_that_started_it_but_not_its_launcher():
    """The kernel signals a worker when the *thread* that started it ends: the worker checks that its
    parent process is gone before it exits; after a SIGKILL of the launcher it is gone in seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (worker,) = watching_pids(proc, 1)
        assert proc.stdout.readline() == "thread ended\n"
        time.sleep(1.0)
        assert pid_running(worker), "the worker died with the thread that started it"
    finally:
        proc.kill()
    print(f"\nworker gone {gone_within([worker], 30):.1f} s after its launcher's SIGKILL")
    assert "its launcher (pid" in proc.stderr.read()


def test_torchrun_workers_die_with_torchrun():
    """Plain torchrun, SIGKILLed: its workers exit (torchrun never got to stop them)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--no-python"]
    proc = subprocess.Popen(
        [*cmd, sys.executable, "-c", WATCHER],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        workers = watching_pids(proc, 2)
    finally:
        proc.kill()
    gone_within(workers, 60)


def test_a_launched_worker_watches_its_launcher(monkeypatch):
    """``goat-dist`` under a launcher (``RANK`` set) asks for the signal before anything else."""
    import goat_dist.lifeline
    from goat_dist import cli

    calls = []
    monkeypatch.setattr(goat_dist.lifeline, "watch_launcher", lambda: calls.append(1))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert calls == []  # a command typed at a shell: nohup and the like keep working
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert calls == [1]


def goat(run_dir: Path, cache: Path, *extra: str, nproc: int = 2) -> list[str]:
    nprocs = ["--nproc", str(nproc)] if nproc > 1 else []
    overrides = [*TINY, "train.max_steps=100000", f"data.cache_dir={cache}", f"run.dir={run_dir}", *extra]
    return [sys.executable, "-m", "goat_dist", "train", *nprocs, *overrides]


def start(cmd: list[str]) -> subprocess.Popen:
    """In a session of its own, as a shell starts a foreground job (Ctrl-C signals its process group)."""
    return subprocess.Popen(
        cmd,
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            steps = [r["step"] for r in records(run_dir) if "loss" in r]
        except (OSError, ValueError):
            steps = []
        if steps and max(steps) >= step:
            return max(steps)
        time.sleep(0.1)
    raise TimeoutError(f"step {step} not reached")


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_one_trainer_per_run_dir_ctrl_c_and_a_killed_launcher(tmp_path, builtin_cache):
    """``goat-dist train --nproc 2`` on a run dir:

    1. a second trainer on that run dir exits 2 with one message naming the holder, and writes nothing;
    2. Ctrl-C (SIGINT to the foreground process group): exit 75, no traceback, the last line names the
       checkpoint and the command that continues; every step once in metrics.jsonl;
    3. the same command continues from that checkpoint; SIGKILL of the launcher: every worker is gone
       within 60 s, no checkpoint is written after the kill, and ``last_exit.json`` still says
       ``running`` (what a killed attempt leaves)."""
    import psutil

    run_dir = tmp_path / "run"
    first = start(goat(run_dir, builtin_cache))
    wait_for_step(run_dir, 2, first)
    lock = json.loads((run_dir / "run.lock.json").read_text())
    assert (
        lock["pid"] != first.pid
        and json.loads((run_dir / "last_exit.json").read_text())["status"] == "running"
    )

    second = subprocess.run(
        goat(run_dir, builtin_cache, nproc=1),
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.count("goat-dist train:") == 1 and "Traceback" not in second.stderr
    assert f"is in use by another trainer: host {lock['host']}, pid {lock['pid']}" in second.stderr
    assert "last heartbeat" in second.stderr and second.stdout == ""

    os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, err = first.communicate(timeout=180)
    assert first.returncode == 75, f"exit {first.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    step = int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])
    assert out.strip().splitlines()[-1] == (
        f"stopped at step {step} (SIGINT): checkpoint {run_dir}/checkpoints/step_{step:08d}; "
        "run the same command to continue"
    )
    logged = [r["step"] for r in records(run_dir) if "loss" in r]
    assert logged == list(range(1, step + 1))  # the refused trainer wrote no step; none twice
    assert json.loads((run_dir / "last_exit.json").read_text())["status"] == "checkpointed"
    assert not (run_dir / "run.lock.json").exists()  # released

    again = start(goat(run_dir, builtin_cache))
    try:
        wait_for_step(run_dir, step + 2, again)
        workers = [c.pid for c in psutil.Process(again.pid).children()]
        assert len(workers) == 2
        saved = checkpoints(run_dir)
        again.kill()  # the launcher only: its workers are in sessions of their own
        print(f"\nworkers gone {gone_within(workers, 60):.1f} s after the launcher's SIGKILL")
    finally:
        again.kill()
        out, err = again.communicate(timeout=60)
    assert f"resumed from {run_dir}/checkpoints/step_{step:08d} (step {step}" in out
    assert checkpoints(run_dir) == saved  # the orphans saved nothing
    assert json.loads((run_dir / "last_exit.json").read_text())["status"] == "running"
