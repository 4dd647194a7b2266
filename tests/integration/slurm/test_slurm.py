"""slurm/train.sbatch, sweep.sbatch and chain.sh on a real Slurm (Debian's 22.05 on localhost, started by
tests/harness/slurm_harness.py): a 2-rank job to completion, preemption and requeue with exact resume, the
time limit seen coming, a crash with bounded restarts, a cancel, an array sweep and a dependency chain.

Skipped, with the reason, where Slurm is not installed or we are not root; .ci/run installs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from harness.faults import fault_env, fault_override
from harness.multiproc import ROOT, TINY, assert_config_is_the_runs, clean_env, per_step, records
from harness.slurm_harness import SlurmCluster, unavailable

pytestmark = pytest.mark.slow
REASON = unavailable()
CONFIG = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def cluster():
    if REASON:
        pytest.skip(REASON)
    c = SlurmCluster()
    c.start()  # installed but not startable is an error, with the log directory in the message
    yield c
    c.stop()


@pytest.fixture(scope="module")
def jobdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm-jobs")


def job_env(cluster, **extra) -> dict:
    """The job inherits this environment (sbatch --export=ALL): the venv's python, CPU settings; a stop
    request is repeated every 2 s (not 10) while a step runs, so short test runs cannot outrun it."""
    return cluster.env(**clean_env(GOAT_PYTHON=sys.executable, GOAT_RESEND_S="2", **extra))


def tiny(cache: Path, *overrides: str) -> list[str]:
    return [*TINY, f"data.cache_dir={cache}", *overrides]


def submit(cluster, jobdir: Path, args: list[str], env: dict | None = None) -> tuple[int, Path]:
    job = cluster.sbatch([f"--output={jobdir}/job-%j.out", *args], env=env or job_env(cluster), cwd=ROOT)
    return job, jobdir / f"job-{job}.out"


def log_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def attempts(run_dir: Path) -> list[dict]:
    path = run_dir / "slurm" / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


def logged_steps(run_dir: Path) -> int:
    try:
        return sum(1 for r in records(run_dir) if "loss" in r)
    except (OSError, ValueError):
        return 0


def last_step(run_dir: Path) -> int:
    """The newest step with a logged loss (0 before any; a line being written counts as not there yet)."""
    try:
        return max(per_step(run_dir), default=0)
    except (OSError, ValueError):
        return 0


def trainer_pids(run_dir: Path) -> list[int]:
    """The training tasks of a job (``python -m goat_dist train ... run.dir=<run_dir>``), not their
    DataLoader workers (children with the same command line) nor the ``srun`` that started them."""
    want = f"run.dir={run_dir}"
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if args[1:4] == ["-m", "goat_dist", "train"] and want in args:  # not srun, whose arguments match too
            found[int(entry.name)] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


def usr1_pending(pid: int) -> bool:
    """SIGUSR1 is pending for the (stopped) process: delivered, its handler not run yet."""
    bit = 1 << (signal.SIGUSR1 - 1)
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    return any(int(line.split()[1], 16) & bit for line in lines if line.startswith(("SigPnd:", "ShdPnd:")))


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def preempt(cluster, job: int, run_dir: Path, ntasks: int) -> None:
    """``USR1`` to the batch script (what ``--signal=B:USR1@N`` does), with the training tasks frozen
    (SIGSTOP) until each holds the forwarded signal pending, then thawed: the run stops at its next step
    boundary however fast this machine trains, instead of racing the signal to its last step."""

    def all_tasks():
        pids = trainer_pids(run_dir)
        return pids if len(pids) == ntasks else None

    pids = wait_for(all_tasks, 60, f"job {job}'s {ntasks} training task(s)")
    _signal_all(pids, signal.SIGSTOP)
    try:
        cluster.signal_batch(job, "USR1")
        wait_for(lambda: all(usr1_pending(p) for p in pids), 90, f"job {job}'s tasks to get the USR1")
    finally:
        _signal_all(pids, signal.SIGCONT)


def epoch(slurm_time: str) -> float:
    return datetime.fromisoformat(slurm_time).timestamp()


def done(cluster, job: int, log: Path, timeout: float = 300, state: str = "COMPLETED") -> dict:
    record = cluster.wait(job, timeout=timeout)
    assert record["JobState"] == state, f"job {job}: {record.get('JobState')}\n{log_text(log)[-6000:]}"
    return record


# ---- 2 ranks to completion, and the same run preempted -------------------------------------------------
@pytest.fixture(scope="module")
def plain(cluster, jobdir, builtin_cache):
    """The uninterrupted 2-rank reference run, submitted once, shared; it runs next to the preempted one."""
    run_dir = jobdir / "plain"
    args = ["--nodes=1", "--ntasks-per-node=2", "slurm/train.sbatch", CONFIG]
    job, log = submit(
        cluster, jobdir, [*args, *tiny(builtin_cache, "train.max_steps=40", f"run.dir={run_dir}")]
    )
    return job, log, run_dir


def test_preemption_checkpoints_requeues_and_resumes_exactly(cluster, jobdir, builtin_cache, plain):
    """Preempted at step 8 or later, requeued, resumed to the uninterrupted run's losses exactly. Rank 0's
    ``last_exit.json`` is written 5 s late and a SIGTERM kills at once (``harness.exit_faults``): the stop
    still counts as checkpointed, because the record is on disk before any rank leaves the final barrier
    and only rank 0 exits non-zero (75)."""
    run_dir = jobdir / "preempted"
    args = ["--nodes=1", "--ntasks-per-node=2", "slurm/train.sbatch", CONFIG]
    late = "train.callbacks=[harness.exit_faults:SlowExitRecord:5]"
    overrides = tiny(builtin_cache, "train.max_steps=40", f"run.dir={run_dir}", late)
    job, log = submit(cluster, jobdir, [*args, *overrides], env=job_env(cluster, **fault_env()))
    wait_for(lambda: logged_steps(run_dir) >= 8, 240, f"job {job} to reach step 8:\n{log_text(log)[-3000:]}")
    preempt(cluster, job, run_dir, ntasks=2)
    signalled = time.time()
    wait_for(lambda: int(cluster.job(job).get("Restarts", 0)) >= 1, 120, f"job {job} to be requeued")
    requeued = time.time()
    wait_for(lambda: "(restart 1)" in log_text(log), 120, f"job {job} to start again")
    restarted = epoch(cluster.job(job)["StartTime"])
    record = done(cluster, job, log)

    assert int(record["Restarts"]) >= 1
    first, *rest = attempts(run_dir)
    # Slurm signals the tasks one by one: rank 0 names SIGUSR1 when it got it before the step's agreement,
    # else the flag another rank's signal raised in that agreement (both a preemption, checkpointed)
    assert first["status"] == "checkpointed" and first["action"] == "requeue"
    assert first["reason"] in ("SIGUSR1", "signal on another rank"), first
    assert 8 <= first["step"] < 40
    assert rest[-1]["status"] == "finished" and rest[-1]["step"] == 40
    text = log_text(log)
    assert "got SIGUSR1" in text and f"resumed from {run_dir / 'checkpoints'}" in text
    assert "task 1: Exited with exit code" not in text  # rank 1 exited 0 after the stop
    assert "FA4 kernel cache: " in text and "kernel cache is off" not in text
    print(f"\nstop: srun exit code {first['step_exit_code']}, record exit code {first['exit_code']}")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    assert_config_is_the_runs(run_dir)  # the requeued attempt's config.yaml: the config it ran with

    plain_job, plain_log, plain_dir = plain
    done(cluster, plain_job, plain_log)
    expected, got = per_step(plain_dir), per_step(run_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 41))
    for step in range(first["step"] + 1, 41):  # after the checkpoint: the uninterrupted run's losses, exactly
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
    print(
        f"\nrequeue latency: signal -> requeued {requeued - signalled:.1f}s, "
        f"signal -> running again {restarted - signalled:.1f}s (checkpoint at step {first['step']})"
    )


def test_two_rank_job_runs_to_completion(cluster, plain):
    job, log, run_dir = plain
    record = done(cluster, job, log)
    assert record["Restarts"] == "0" and record["Requeue"] == "1"
    assert max(per_step(run_dir)) == 40
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    assert json.loads((run_dir / "last_exit.json").read_text())["status"] == "finished"
    text = log_text(log)
    assert "goat-dist doctor: all checks passed" in text
    assert "layout: world 2" in text  # the two srun tasks formed one world
    # the launch environment, exported before the first step (goat_slurm.py env); no kernel warm-up step
    # without GPUs in the allocation, said before training
    assert (
        "environment: CUDA_DEVICE_MAX_CONNECTIONS=1 " in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in text
    )
    assert text.index("kernels: the job has no GPUs") < text.index("training: srun")
    m = re.search(r"all-reduce: 2 ranks, gloo, .*?algbw ([\d.]+) GB/s", text)
    assert m, text[-4000:]
    print(f"\ndoctor all-reduce bandwidth (2 ranks, gloo, 16 MiB): {m.group(1)} GB/s")


def test_time_limit_is_seen_coming(cluster, jobdir, builtin_cache):
    """--time=1 on a run far longer than any attempt can hold (10^6 steps): the trainer saves before the
    limit by itself, the job requeues itself and the next attempt resumes from that checkpoint and trains
    on; then this test ends the job. Nothing here depends on how fast the machine trains. Never TIMEOUT.

    Slurm's warning signal is turned into one the job script ignores (SIGURG, whose default action is to
    ignore it): Slurm may send it "up to 60 seconds earlier than specified" (sbatch(1), --signal), which
    in a 1-minute job is any time, and a USR1 would then stop the attempt before the trainer's own
    deadline could be seen at work. Without it, only the trainer's deadline can save in time."""
    run_dir = jobdir / "timelimit"
    args = ["--ntasks=1", "--time=1", "--signal=B:URG@1", "slurm/train.sbatch", CONFIG]
    job, log = submit(
        cluster, jobdir, [*args, *tiny(builtin_cache, "train.max_steps=1000000", f"run.dir={run_dir}")]
    )
    try:  # the job trains until cancelled: a failure here must not leave it running
        first_end = wait_for(
            lambda: cluster.job(job).get("EndTime") if "(restart 0)" in log_text(log) else None, 120, "start"
        )
        wait_for(lambda: int(cluster.job(job).get("Restarts", 0)) >= 1, 150, f"job {job} to requeue itself")
        cluster.scontrol("update", f"jobid={job}", "TimeLimit=15")  # the test, not the limit, ends attempt 2
        first = attempts(run_dir)[0]
        assert first["status"] == "checkpointed" and first["reason"] == "deadline", first
        assert first["ended"] < epoch(first_end), "the first attempt ended after the time limit"
        wait_for(
            lambda: "(restart 1)" in log_text(log) and last_step(run_dir) > first["step"] + 1,
            240,
            f"job {job}'s second attempt to train:\n{log_text(log)[-3000:]}",
        )
    finally:
        cluster.cancel(job)
    record = cluster.wait(job, timeout=120)

    assert int(record["Restarts"]) >= 1
    text = log_text(log)
    second = text.split("(restart 1)", 1)[1]
    resumed = re.search(r"resumed from (\S+) \(step (\d+)", second)
    assert resumed, second[-3000:]
    assert resumed.group(1) == str(run_dir / "checkpoints" / f"step_{first['step']:08d}")
    assert int(resumed.group(2)) == first["step"]
    steps = per_step(run_dir)
    assert sorted(steps) == list(range(1, max(steps) + 1))  # no step lost or repeated across the requeue
    assert "DUE TO TIME LIMIT" not in text
    print(
        f"\ntime limit: first attempt saved at step {first['step']} "
        f"{epoch(first_end) - first['ended']:.0f}s before the limit; the second trained to {max(steps)}"
    )


def test_crash_is_restarted_a_bounded_number_of_times(cluster, jobdir, builtin_cache):
    """A run killed at step 3 every time (a test callback, harness.faults: SIGKILL while saving step 3):
    retried once (--max-restarts 1), then the job fails, with the error in its log."""
    run_dir = jobdir / "crash"
    overrides = tiny(builtin_cache, "train.max_steps=10", "checkpoint.interval=3", f"run.dir={run_dir}")
    overrides.append(fault_override("KillBeforePublish:3"))
    env = job_env(cluster, **fault_env())
    args = ["--ntasks=1", "slurm/train.sbatch", "--max-restarts", "1", CONFIG, *overrides]
    job, log = submit(cluster, jobdir, args, env=env)
    record = done(cluster, job, log, state="FAILED")
    assert record["Restarts"] == "1" and record["ExitCode"] == "1:0"
    tries = attempts(run_dir)
    assert [a["status"] for a in tries] == ["failed", "failed"]
    assert [a["action"] for a in tries] == ["requeue", "give-up"]
    assert tries[0]["reason"].startswith("killed: rank 0")  # its last_exit.json still said "running"
    text = log_text(log)
    assert "training failed" in text and "restart 1 of at most 1" in text
    assert "giving up" in text and re.search(r"srun: error: .*task 0: Killed", text)
    assert not (run_dir / "checkpoints" / "latest").exists()
    # the requeued attempt (a new process on the same host) took the dead one's run lock over
    second = text.split("(restart 1)", 1)[1]
    assert "took over the lock of a trainer that is gone" in second, second[-3000:]


def test_a_pinned_fork_requeued_after_a_kill_continues_from_its_own_newest(
    cluster, jobdir, builtin_cache, plain
):
    """``run.dir=fork train.resume=<plain>/step_40``, one task, SIGKILLed once step 42 is saved
    (``KillAfter:42``, every attempt that reaches step 42): the requeue keeps the same overrides and must
    continue from the fork's own step 42, so it never reaches step 42's kill again and finishes at 46.
    Resumed from the pin instead, it would be killed again and the job would fail."""
    job, log, source = plain
    done(cluster, job, log)
    pin = source / "checkpoints" / "step_00000040"
    run_dir = jobdir / "pinned-fork"
    overrides = tiny(
        builtin_cache,
        "train.max_steps=46",
        "checkpoint.interval=2",
        f"run.dir={run_dir}",
        f"train.resume={pin}",
    )
    overrides.append(fault_override("KillAfter:42"))
    args = ["--ntasks=1", "slurm/train.sbatch", "--max-restarts", "1", CONFIG, *overrides]
    job, log = submit(cluster, jobdir, args, env=job_env(cluster, **fault_env()))
    record = done(cluster, job, log)
    assert record["Restarts"] == "1", record
    assert [(a["status"], a["action"]) for a in attempts(run_dir)][0] == ("failed", "requeue")
    text = log_text(log)
    first, second = text.split("(restart 1)", 1)
    assert f"resumed from {pin} (step 40" in first, first[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000042'} (step 42" in second, second[-3000:]
    assert "continuing from the newest" in second
    assert not (run_dir / "checkpoints" / "stale").exists()  # nothing the fork wrote was moved aside
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000046"
    assert (source / "checkpoints" / "latest").read_text().strip() == "step_00000040"  # the source untouched


def srun_pids(run_dir: Path) -> list[int]:
    """The ``srun`` processes of a job's training step (``srun ... goat_dist train run.dir=<run_dir>``)."""
    want, found = f"run.dir={run_dir}", []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if entry.name.isdigit() and Path(args[0]).name == "srun" and want in args:
            found.append(int(entry.name))
    return found


def test_killed_srun_takes_its_tasks_along_without_a_checkpoint(cluster, jobdir, builtin_cache):
    """SIGKILL of the training step's srun: Slurm leaves the step's tasks training until the job ends and
    then sends them SIGTERM, at which the trainer saves. train.sbatch ends them at once with SIGKILL: no
    checkpoint, and the attempt counts as killed (its last_exit.json still says "running")."""
    from goat_dist.run_lock import pid_running

    run_dir = jobdir / "srun-killed"
    overrides = tiny(builtin_cache, "train.max_steps=100000", f"run.dir={run_dir}")
    job, log = submit(
        cluster, jobdir, ["--ntasks=1", "slurm/train.sbatch", "--max-restarts", "0", CONFIG, *overrides]
    )
    wait_for(lambda: logged_steps(run_dir) >= 2, 240, f"job {job} to train:\n{log_text(log)[-3000:]}")
    tasks, sruns = trainer_pids(run_dir), srun_pids(run_dir)
    assert tasks and sruns
    _signal_all(sruns, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: not any(pid_running(p) for p in tasks), 60, "the tasks to end")
    print(f"\ntasks gone {time.monotonic() - killed:.1f} s after their srun's SIGKILL")
    done(cluster, job, log, state="FAILED")
    (first,) = attempts(run_dir)
    assert (first["status"], first["action"]) == ("failed", "give-up") and first["reason"].startswith(
        "killed"
    )
    assert not list(run_dir.glob("checkpoints/step_*")), "a task saved after its srun was killed"
    assert "outlived its srun" in log_text(log)


def test_cancel_is_not_undone_by_requeue(cluster, jobdir, builtin_cache):
    run_dir = jobdir / "cancelled"
    args = [
        "--ntasks=1",
        "slurm/train.sbatch",
        CONFIG,
        *tiny(builtin_cache, "train.max_steps=5000", f"run.dir={run_dir}"),
    ]
    job, log = submit(cluster, jobdir, args)
    wait_for(lambda: logged_steps(run_dir) >= 3, 240, f"job {job} to train")
    cluster.cancel(job)
    cluster.wait(job, timeout=120)
    # the batch script's last word: it decided not to requeue (no sleep guessing how long a requeue takes)
    wait_for(lambda: "was cancelled" in log_text(log), 60, f"job {job}'s decision:\n{log_text(log)[-3000:]}")
    record = cluster.job(job)
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", record


def test_sweep_array_and_dependency_chain(cluster, jobdir, builtin_cache):
    """A 3-element job array (GOAT vs RoPE vs ALiBi) and, at the same time, a 2-link chain whose first job is
    stopped by a signal (GOAT_REQUEUE=0: it ends) and whose second job continues the run."""
    sweep_dir = jobdir / "sweep"
    sweep = [
        "--array=0-2",
        "--ntasks=1",
        f"--output={jobdir}/sweep-%A_%a.out",
        "slurm/sweep.sbatch",
        "slurm/sweeps/positions.txt",
        CONFIG,
        *tiny(builtin_cache, "train.max_steps=6", f"run.dir={sweep_dir}"),
    ]
    array_job = cluster.sbatch(sweep, env=job_env(cluster), cwd=ROOT)

    chain_dir = jobdir / "chain"
    chain = subprocess.run(
        [
            "slurm/chain.sh",
            "2",
            "--ntasks=1",
            f"--output={jobdir}/chain-%j.out",
            "slurm/train.sbatch",
            CONFIG,
            *tiny(builtin_cache, "train.max_steps=80", f"run.dir={chain_dir}"),
        ],
        env=job_env(cluster),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chain.returncode == 0, chain.stderr
    first, second = (int(x) for x in chain.stdout.split())
    assert cluster.job(second)["Dependency"].startswith(f"afterany:{first}")
    wait_for(lambda: logged_steps(chain_dir) >= 3, 240, "the chain's first job to train")
    preempt(cluster, first, chain_dir, ntasks=1)

    elements = cluster.wait_array(array_job, timeout=300)
    assert [e["JobState"] for e in elements] == ["COMPLETED"] * 3, elements
    for index, position in enumerate(("goat", "rope", "alibi")):
        run_dir = sweep_dir / str(index)
        assert max(per_step(run_dir)) == 6
        assert f"position: {position}" in (run_dir / "config.yaml").read_text()
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000006"

    first_log, second_log = (jobdir / f"chain-{j}.out" for j in (first, second))
    r1 = done(cluster, first, first_log)
    r2 = done(cluster, second, second_log)
    assert r1["Restarts"] == r2["Restarts"] == "0"  # chain links never requeue themselves
    assert epoch(r2["StartTime"]) >= epoch(r1["EndTime"])
    a1, a2 = attempts(chain_dir)
    assert (a1["job_id"], a1["status"], a1["action"]) == (str(first), "checkpointed", "stop")
    assert (a2["job_id"], a2["status"], a2["step"]) == (str(second), "finished", 80)
    assert "resumed from" in log_text(second_log)


def test_deadline_reads_the_job_end_time_from_slurm(cluster, jobdir):
    """Deadline.from_config in a real job, SLURM_JOB_END_TIME unset: it asks squeue; matches scontrol."""
    probe = (
        "import os, types; os.environ.pop('SLURM_JOB_END_TIME', None); "
        "import importlib.util as u; s = u.spec_from_file_location('dl', 'goat_dist/trainer/deadline.py'); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); Deadline = m.Deadline; "
        "d = Deadline.from_config(types.SimpleNamespace(stop_at=None, time_limit_minutes=0)); "
        "print('END', int(d.end), d.source)"
    )
    job = cluster.sbatch(
        ["--time=7", f"--output={jobdir}/probe-%j.out", f'--wrap={sys.executable} -c "{probe}"'],
        env=job_env(cluster),
        cwd=ROOT,
    )
    log = jobdir / f"probe-{job}.out"
    record = done(cluster, job, log, timeout=120)
    m = re.search(r"END (\d+) (.*)", log_text(log))
    assert m, log_text(log)
    start = epoch(record["StartTime"])
    assert int(m.group(1)) == int(start) + 7 * 60
    assert m.group(2) == f"Slurm job {job} end time"


def test_stopping_the_cluster_cancels_its_jobs_first(cluster, jobdir):
    """``SlurmCluster.stop`` (this module's teardown) cancels what is still queued before it stops the
    daemons (``cancel_all``): a job step outlives slurmd, so a test that fails before it cancels its own
    job would leave it running through the tests after it."""
    job = cluster.sbatch([f"--output={jobdir}/sleep-%j.out", "--wrap=sleep 600"], env=job_env(cluster))
    wait_for(lambda: cluster.job(job).get("JobState") == "RUNNING", 60, f"job {job} to start")
    cluster.cancel_all()
    assert cluster.queued() == []
    assert cluster.job(job)["JobState"] == "CANCELLED"
