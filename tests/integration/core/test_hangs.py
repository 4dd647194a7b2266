"""A frozen rank ends the whole job: 2 ranks under goat-dist's own launcher (``train --nproc 2``), one
SIGSTOPped mid-run, ``parallel.timeout_minutes=0.5``. The other rank's collective times out, it prints
every thread's stack (the step watchdog), records the failure in ``last_exit.json`` and exits non-zero;
the launcher then ends the frozen rank. Marked slow (about a minute and a half)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.multiproc import ROOT, clean_env, per_step, tiny

pytestmark = pytest.mark.slow

JOB_LIMIT_S = 240  # the job must end by itself within this, counted from the freeze


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The training process of ``rank`` in the world training into ``run_dir``: its command names the run
    dir and its environment the rank; not the launcher (no RANK) nor a DataLoader worker (its parent has
    the same rank)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if f"run.dir={run_dir}" not in args or _environ(int(entry.name)).get("RANK") != str(rank):
                continue
            found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    roots = [pid for pid, ppid in found.items() if ppid not in found]
    return roots[0] if len(roots) == 1 else None


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


def logged_step(run_dir: Path) -> int:
    try:
        return max(per_step(run_dir), default=0)
    except (OSError, ValueError):
        return 0


def test_a_frozen_rank_ends_the_job(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    overrides = [
        *tiny(),
        "train.max_steps=1000000",  # it ends only because of the frozen rank
        "parallel.timeout_minutes=0.5",
        "checkpoint.save_at_end=false",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    cmd = [sys.executable, "-m", "goat_dist", "train", "--nproc", "2", *overrides]
    out, err = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    job = subprocess.Popen(cmd, env=clean_env(), cwd=ROOT, stdout=out, stderr=err)
    frozen = None
    try:
        wait_for(lambda: logged_step(run_dir) >= 2 or job.poll() is not None, 400, "a logged step 2")
        assert job.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        frozen = wait_for(lambda: rank_pid(run_dir, 1), 30, "rank 1's process")
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        code = job.wait(timeout=JOB_LIMIT_S)
        ended_s = time.monotonic() - t0
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
        out.close()
        err.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code != 0 and ended_s < JOB_LIMIT_S, stderr[-3000:]
    assert "rank 0 of 2 failed with exit code" in stderr, stderr[-3000:]  # the other rank, non-zero
    record = json.loads((run_dir / "last_exit.json").read_text())
    assert record["status"] == "failed" and record["step"] >= 2, record
    assert "a collective timed out (parallel.timeout_minutes=0.5)" in record["reason"], record
    assert "most recent call first" in stderr  # the step watchdog's stacks of the waiting rank
