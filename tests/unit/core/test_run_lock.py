"""One live trainer per run directory (``run_lock.py``), in-process: the lock refuses a second
holder naming the first, takes over a holder that is gone (and says so), keeps a heartbeat, lets go on
release; ``last_exit.json`` says ``running`` while an attempt runs, and the job scripts' classifier reads a
``running`` record left behind as a killed attempt."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from goat_dist import run_lock
from goat_dist.run_lock import RunDirError, RunLock

SLURM = Path(__file__).resolve().parents[3] / "slurm"


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def take(run_dir: Path) -> tuple[RunLock, list[str]]:
    said: list[str] = []
    return RunLock(run_dir, log=said.append).acquire(), said


def holder(run_dir: Path, **fields) -> dict:
    """A record of another trainer, as it would have written it."""
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": run_lock._start_ticks(os.getpid()),
        "boot_id": run_lock._boot_id(),
        "job_id": None,
        "restart_count": 0,
        "started": time.time() - 60,
        "heartbeat": time.time(),
        "token": "theirs",
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / run_lock.RECORD_NAME).write_text(json.dumps(record))
    return record


def test_a_second_holder_is_refused_naming_the_first_until_it_lets_go(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first, said = take(tmp_path / "run")
    record = json.loads((tmp_path / "run" / run_lock.RECORD_NAME).read_text())
    assert (record["host"], record["pid"], record["job_id"]) == (socket.gethostname(), os.getpid(), "4242")
    assert said == []
    with pytest.raises(RunDirError) as refused:
        take(tmp_path / "run")  # the same host: the flock is held (a second open file, same process)
    message = str(refused.value)
    for word in (f"host {socket.gethostname()}", f"pid {os.getpid()}", "Slurm job 4242", "last heartbeat"):
        assert word in message, message
    assert "choose another run.dir" in message
    first.release()
    assert not (tmp_path / "run" / run_lock.RECORD_NAME).exists()
    second, said = take(tmp_path / "run")
    assert said == []  # a released lock is free: nothing taken over
    second.release()
    second.release()  # idempotent


def test_a_holder_gone_from_this_host_is_taken_over_and_said(tmp_path):
    """A SIGKILLed trainer left its record; its flock went with it: taken over at once, on the console."""
    old = holder(tmp_path / "run", pid=999_999_999, token="dead")
    lock, said = take(tmp_path / "run")
    assert len(said) == 1 and "took over the lock of a trainer that is gone" in said[0]
    assert f"pid {old['pid']}" in said[0]
    assert json.loads((tmp_path / "run" / run_lock.RECORD_NAME).read_text())["token"] == lock.token
    lock.release()


def test_another_hosts_holder_counts_while_its_heartbeat_is_fresh(tmp_path, monkeypatch):
    """flock may not reach across nodes (it is free here): the heartbeat decides."""
    holder(tmp_path / "run", host="node-17", pid=12, job_id="77", heartbeat=time.time() - 20)
    with pytest.raises(RunDirError, match=r"host node-17, pid 12, Slurm job 77 .*last heartbeat 2\d s ago"):
        take(tmp_path / "run")
    holder(tmp_path / "run", host="node-17", pid=12, heartbeat=time.time() - run_lock.STALE_AFTER_S - 5)
    lock, said = take(tmp_path / "run")
    assert "no heartbeat for more than 300 s" in said[0] and "host node-17" in said[0]
    lock.release()


def test_a_requeued_slurm_job_takes_over_its_earlier_attempt(tmp_path, monkeypatch):
    """Same job id, another restart count: Slurm ended that attempt before starting this one, even when
    it ran on another node whose heartbeat is still fresh."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    holder(tmp_path / "run", host="node-17", job_id="77", restart_count=0)
    lock, said = take(tmp_path / "run")
    assert "an earlier attempt of this Slurm job (requeued)" in said[0]
    lock.release()
    holder(tmp_path / "run", host="node-17", job_id="77", restart_count=1)  # the same attempt: alive
    with pytest.raises(RunDirError):
        take(tmp_path / "run")


def test_a_restarted_host_frees_its_holders(tmp_path):
    holder(tmp_path / "run", boot_id="another-boot")
    fcntl_free = take(tmp_path / "run")
    assert "this host restarted since" in fcntl_free[1][0]
    fcntl_free[0].release()


def test_without_flock_a_live_pid_on_this_host_holds_it(tmp_path, monkeypatch):
    """A file system without flock (ENOLCK): the record decides; a live process (this one, its start time
    matching) holds the lock, a dead one does not."""

    def no_flock(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    holder(tmp_path / "run")
    with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
        take(tmp_path / "run")
    holder(tmp_path / "run", pid_start=1)  # the same pid, another process (reused)
    lock, said = take(tmp_path / "run")
    assert "its process is not running" in said[0]
    lock.release()


def test_a_claim_that_loses_the_race_is_refused_naming_the_winner(tmp_path, monkeypatch):
    """The record is created with link(): where another start wrote one first, the claim looks again."""
    run_dir = tmp_path / "run"
    real_link = os.link

    def link_after_them(src, dst):
        holder(run_dir, host="node-3", pid=5, token="winner")
        return real_link(src, dst)

    monkeypatch.setattr(run_lock.os, "link", link_after_them)
    with pytest.raises(RunDirError, match="host node-3, pid 5"):
        take(run_dir)


def test_heartbeat_is_refreshed_and_a_lost_lock_is_said_once(tmp_path, capsys):
    lock, _ = take(tmp_path / "run")
    path = tmp_path / "run" / run_lock.RECORD_NAME
    before = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.01)
    lock.refresh()
    assert json.loads(path.read_text())["heartbeat"] > before
    holder(tmp_path / "run", host="node-9", token="new-owner")  # taken over while this one was frozen
    lock.refresh()
    lock.refresh()
    assert capsys.readouterr().err.count("taken over by another trainer (host node-9") == 1
    assert json.loads(path.read_text())["token"] == "new-owner"  # not overwritten
    lock.release()
    assert json.loads(path.read_text())["token"] == "new-owner"  # not removed: it is not ours


def test_heartbeat_thread_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock, _ = take(tmp_path / "run")
    path = tmp_path / "run" / run_lock.RECORD_NAME
    first = json.loads(path.read_text())["heartbeat"]
    deadline = time.time() + 10
    while json.loads(path.read_text())["heartbeat"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert json.loads(path.read_text())["heartbeat"] > first
    lock.release()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_a_run_dir_that_cannot_be_written_is_named(tmp_path, where):
    run_dir = tmp_path / "file" / "run" if where == "under-a-file" else Path("/proc/goat-no-such-dir")
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=f"run.dir={run_dir} cannot be written .*fix: choose a directory"):
        take(run_dir)


def test_a_read_only_run_dir_is_named_and_left_unlocked(tmp_path, monkeypatch):
    """The lock file may exist already (an earlier run); the record is what needs a new file."""

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(run_lock, "temp_path_for", read_only)
    with pytest.raises(RunDirError, match=r"cannot be written \(Read-only file system\); fix:"):
        take(tmp_path / "run")
    monkeypatch.undo()
    take(tmp_path / "run")[0].release()  # the refused attempt holds nothing


def test_world_of_one_marks_the_attempt_running_then_lets_go(tmp_path):
    from goat_dist.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    world = run_lock.WorldLock(cfg, log=lambda *a: None)
    world.hold()
    assert world.held
    record = json.loads((tmp_path / "run" / "last_exit.json").read_text())
    assert record["status"] == "running" and record["pid"] == os.getpid()
    assert record["host"] == socket.gethostname() and record["started"] <= time.time()
    world.release()
    assert not (tmp_path / "run" / run_lock.RECORD_NAME).exists()


def test_other_ranks_touch_no_lock_file(tmp_path, monkeypatch):
    """Per-rank cost does not grow with the world: only rank 0 opens, reads or writes the lock."""
    from goat_dist.config import load_config

    monkeypatch.setenv("RANK", "3")
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    world = run_lock.WorldLock(cfg)
    world.hold()  # a world of one here (no WORLD_SIZE): no collective to wait in
    assert world.lock is None and world.held and not (tmp_path / "run").exists()
    world.release()


def test_a_refused_rank0_writes_nothing_into_the_live_run_dir(tmp_path, monkeypatch):
    """entry.run: the refusal is a user error (exit 2) and the live trainer's records stay its own."""
    from goat_dist.config import load_config
    from goat_dist.trainer import entry

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    live, _ = take(cfg.run_dir)
    (cfg.run_dir / "last_exit.json").write_text('{"status": "running", "pid": 1}')
    monkeypatch.setattr(entry, "Trainer", lambda cfg: pytest.fail("built a trainer"))
    # the failure path tears the process groups down: not the test session's own world
    monkeypatch.setattr(entry.distributed, "teardown", lambda barrier=True: None)
    with pytest.raises(RunDirError) as refused:
        entry.run(cfg)
    assert entry.exit_code_for(refused.value) == 2
    assert json.loads((cfg.run_dir / "last_exit.json").read_text()) == {"status": "running", "pid": 1}
    live.release()


def test_a_running_record_left_behind_is_a_killed_attempt(tmp_path):
    """slurm/goat_slurm.py decide: the attempt's own start record, never replaced by an end record."""
    sys.path.insert(0, str(SLURM))
    try:
        import goat_slurm
    finally:
        sys.path.remove(str(SLURM))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "last_exit.json").write_text(
        json.dumps({"status": "checkpointed", "reason": "SIGUSR1", "step": 8, "exit_code": 75, "time": 1})
    )
    goat_slurm.begin(run_dir, "99")
    run_lock.mark_running(run_dir, {"started": time.time(), "host": "node-1", "pid": 4321})
    for code in (137, 0, 75):
        outcome = goat_slurm.read_outcome(
            run_dir, code, goat_slurm._read_state(run_dir)["last_exit_before"], "slurm"
        )
        assert outcome.status == "failed" and outcome.source == "last_exit.json", outcome
        assert "killed" in outcome.reason and "host node-1, pid 4321" in outcome.reason
    action, message = goat_slurm.decide(run_dir, 137, max_restarts=1, job_id="99")
    assert action == "requeue" and "killed" in message


def test_a_users_config_in_the_run_dir_is_refused_and_kept(tmp_path, monkeypatch):
    """`train --config exp/config.yaml run.dir=exp`: the run would replace the user's file with its resolved
    config (comments and `auto` values lost). entry.run refuses before anything is written (exit 2)."""
    from goat_dist.config import load_config
    from goat_dist.trainer import entry

    run_dir = tmp_path / "exp"
    run_dir.mkdir()
    mine = "# my experiment, keep these notes\ntrain:\n  precision: auto\n"
    (run_dir / "config.yaml").write_text(mine)
    cfg = load_config(run_dir / "config.yaml", [f"run.dir={run_dir}"])
    monkeypatch.setattr(entry, "Trainer", lambda cfg: pytest.fail("built a trainer"))
    monkeypatch.setattr(entry.distributed, "teardown", lambda barrier=True: None)
    with pytest.raises(RunDirError, match=f"{run_dir / 'config.yaml'} was not written by a goat-dist run"):
        entry.run(cfg)
    assert (run_dir / "config.yaml").read_text() == mine
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # no lock, no last_exit.json


def test_the_runs_own_config_and_an_older_runs_are_replaced(tmp_path):
    """A config.yaml the run wrote (its header) is rewritten at the next start; one without the header in a
    directory a run trained into (an older version's) too: neither is refused."""
    from goat_dist.config import RUN_CONFIG_HEADER, foreign_run_config, load_config, save_run_config

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    cfg.run_dir.mkdir()
    written = save_run_config(cfg, cfg.run_dir)
    assert written.read_text().startswith(RUN_CONFIG_HEADER)
    assert load_config(written, []).to_dict() == cfg.to_dict()  # the header is a YAML comment
    assert foreign_run_config(cfg.run_dir) is None
    written.write_text(written.read_text()[len(RUN_CONFIG_HEADER) :])  # an older version's, no header
    assert foreign_run_config(cfg.run_dir) == written  # alone in the dir: could be the user's
    (cfg.run_dir / "metrics.jsonl").write_text("")
    assert foreign_run_config(cfg.run_dir) is None  # beside a run's records: the run's
