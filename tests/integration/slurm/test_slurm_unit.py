"""slurm/goat_slurm.py without a cluster: node lists, the rank mapping of faked 2- and 4-node Slurm
environments, ports, the requeue decision, and the job scripts' argument handling."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("goat_slurm", ROOT / "slurm" / "goat_slurm.py")
gs = importlib.util.module_from_spec(_spec)
sys.modules["goat_slurm"] = gs
_spec.loader.exec_module(gs)


# ---- node lists -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expr, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("node[01-02,07],gpu-a[9-10]", ["node01", "node02", "node07", "gpu-a9", "gpu-a10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a1,b[3],c", ["a1", "b3", "c"]),
        ("n[008-011]-ib", ["n008-ib", "n009-ib", "n010-ib", "n011-ib"]),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert gs.expand_hostlist(expr) == hosts


def test_expand_hostlist_matches_scontrol(tmp_path):
    if not any(Path(p, "scontrol").exists() for p in os.environ.get("PATH", "").split(":")):
        pytest.skip("scontrol not installed")
    conf = tmp_path / "slurm.conf"  # scontrol wants a configuration, even to expand a host list
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=ALL\n")
    expr = "node[01-02,07],gpu-a[9-10],x"
    out = subprocess.run(
        ["scontrol", "show", "hostnames", expr],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "SLURM_CONF": str(conf)},
    )
    if out.returncode:
        pytest.skip(f"scontrol show hostnames does not work here: {out.stderr.strip()}")
    assert gs.expand_hostlist(expr) == out.stdout.split()


@pytest.mark.parametrize(
    "spec, counts", [("2", [2]), ("4(x2)", [4, 4]), ("4(x2),3", [4, 4, 3]), ("8(x4)", [8, 8, 8, 8])]
)
def test_tasks_per_node(spec, counts):
    assert gs.tasks_per_node(spec) == counts


def test_tasks_per_node_rejects_garbage():
    with pytest.raises(gs.SlurmEnvError, match="SLURM_TASKS_PER_NODE"):
        gs.tasks_per_node("four")


# ---- rank mapping on faked multi-node jobs ---------------------------------------------------------------
def fake_job(nodelist: str, nodes: int, per_node: int, job_id: int = 4242, **extra) -> list[dict]:
    """The environment Slurm gives every task of a step with block distribution (what srun does by
    default): task ids fill node 0 first, then node 1, ..."""
    hosts = gs.expand_hostlist(nodelist)
    assert len(hosts) == nodes
    envs = []
    for node in range(nodes):
        for local in range(per_node):
            envs.append(
                {
                    "SLURM_JOB_ID": str(job_id),
                    "SLURM_PROCID": str(node * per_node + local),
                    "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(node),
                    "SLURM_NTASKS": str(nodes * per_node),
                    "SLURM_NNODES": str(nodes),
                    "SLURM_STEP_NODELIST": nodelist,
                    "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
                    "SLURMD_NODENAME": hosts[node],
                    **extra,
                }
            )
    return envs


@pytest.mark.parametrize("nodes, per_node, nodelist", [(2, 4, "gpu[07-08]"), (4, 8, "dgx-a[1-2],dgx-b[5-6]")])
def test_rank_mapping_multi_node(nodes, per_node, nodelist):
    hosts = gs.expand_hostlist(nodelist)
    envs = fake_job(nodelist, nodes, per_node)
    mapped = [gs.torch_env(e, hosts) for e in envs]
    world = nodes * per_node
    assert sorted(int(m["RANK"]) for m in mapped) == list(range(world))  # every rank exactly once
    for env, m in zip(envs, mapped):
        node = int(env["SLURM_NODEID"])
        assert m["MASTER_ADDR"] == hosts[0]
        assert m["WORLD_SIZE"] == str(world)
        assert m["LOCAL_WORLD_SIZE"] == str(per_node)
        assert m["NODE_RANK"] == m["GROUP_RANK"] == str(node)
        assert m["GROUP_WORLD_SIZE"] == str(nodes)
        assert int(m["RANK"]) == node * per_node + int(m["LOCAL_RANK"])
        assert env["SLURMD_NODENAME"] == hosts[node]
    # one rendezvous point for all tasks, derived from the job id
    assert len({(m["MASTER_ADDR"], m["MASTER_PORT"]) for m in mapped}) == 1
    assert mapped[0]["MASTER_PORT"] == str(gs.derive_port(4242))


def test_rank_mapping_uneven_nodes_and_overrides():
    hosts = ["n1", "n2", "n3"]
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "8",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "9",
        "SLURM_NNODES": "3",
        "SLURM_TASKS_PER_NODE": "4(x2),1",
        "GOAT_MASTER_ADDR": "n1-ib",
        "GOAT_MASTER_PORT": "29500",
    }
    m = gs.torch_env(env, hosts)
    assert (m["RANK"], m["LOCAL_WORLD_SIZE"], m["WORLD_SIZE"]) == ("8", "1", "9")
    assert (m["MASTER_ADDR"], m["MASTER_PORT"]) == ("n1-ib", "29500")
    assert gs.torch_env(env, hosts, offset=1)["MASTER_PORT"] == "29501"  # the preflight's own port


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_PROCID": None}, "SLURM_PROCID is not set"),
        ({"SLURM_NTASKS": "7"}, "do not add up"),
        ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5"),
        ({"SLURM_LOCALID": "4"}, "out of range"),
        ({"SLURMD_NODENAME": "gpu08"}, "this node gpu08 is host #1"),
        ({"SLURM_PROCID": "x"}, "not an integer"),
    ],
)
def test_rank_mapping_rejects_inconsistent_env(change, message):
    env = fake_job("gpu[07-08]", 2, 4)[0]
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(gs.SlurmEnvError, match=message):
        gs.torch_env(env, ["gpu07", "gpu08"])


def test_host_list_must_match_node_count():
    env = fake_job("gpu[07-08]", 2, 4)[0]
    with pytest.raises(gs.SlurmEnvError, match="host list has 1 hosts"):
        gs.torch_env(env, ["gpu07"])


def test_ports_differ_by_job_restart_and_purpose():
    ports = {gs.derive_port(j, r, o) for j in (100, 101, 102) for r in (0, 1) for o in (0, 1)}
    assert len(ports) == 12
    assert all(gs.PORT_BASE <= p < gs.PORT_BASE + gs.PORT_SPAN for p in ports)
    assert gs.derive_port(100, 0) == gs.derive_port(100, 2)  # stable: every task derives the same


def test_exec_sets_env_and_ignores_usr1(tmp_path):
    """The srun task wrapper: torch's variables set, SIGUSR1 ignored until the trainer installs a handler."""
    env = {**fake_job("gpu[07-08]", 2, 4)[5], "PATH": os.environ["PATH"]}
    probe = (
        "import json, os, signal; print(json.dumps({k: os.environ[k] for k in "
        "('RANK','LOCAL_RANK','WORLD_SIZE','MASTER_ADDR','MASTER_PORT','OMP_NUM_THREADS')} | "
        "{'usr1_ignored': signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,"
        " 'term_ignored': signal.getsignal(signal.SIGTERM) == signal.SIG_IGN}))"
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "slurm" / "goat_slurm.py"), "exec", "--", sys.executable, "-c", probe],
        env={**env, "GOAT_SLURM_HOSTS": "gpu07 gpu08"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(gs.derive_port(4242)),
        "OMP_NUM_THREADS": "1",
        "usr1_ignored": True,
        "term_ignored": True,
    }


def test_exec_turns_fa4s_cache_off_in_a_directory_others_can_write(tmp_path):
    """FA4 loads compiled code from its cache: in /tmp, the directory must be this user's alone."""
    assert gs.private_dir_problem(tmp_path / "mine") is None
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700  # made private where absent
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert "writable by other users" in gs.private_dir_problem(shared)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    assert "not a directory" in gs.private_dir_problem(tmp_path / "link")

    env = {**fake_job("gpu[07-08]", 2, 4)[4], "PATH": os.environ["PATH"], "GOAT_SLURM_HOSTS": "gpu07 gpu08"}
    probe = "import os; print(os.environ['FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED'])"
    helper = [
        sys.executable,
        str(ROOT / "slurm" / "goat_slurm.py"),
        "exec",
        "--",
        sys.executable,
        "-c",
        probe,
    ]
    for private, enabled in ((tmp_path / "mine", "1"), (shared, "0")):
        env.update(GOAT_PRIVATE_DIR=str(private), FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1")
        out = subprocess.run(helper, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == enabled, out.stderr
    assert "FA4's kernel cache is off on this node" in out.stderr  # task 4 is local rank 0 of node 1


def test_exec_reports_a_broken_env():
    out = subprocess.run(
        [sys.executable, str(ROOT / "slurm" / "goat_slurm.py"), "exec", "--", "true"],
        env={"PATH": os.environ["PATH"], "SLURM_JOB_NODELIST": "x[1-2]"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "SLURM_PROCID is not set" in out.stderr


# ---- the requeue decision --------------------------------------------------------------------------------
def write_exit(run_dir: Path, status: str, reason=None, step=10, exit_code=0) -> None:
    record = {"status": status, "reason": reason, "step": step, "exit_code": exit_code}
    (run_dir / "last_exit.json").write_text(json.dumps(record))


def attempt(run_dir: Path, status=None, exit_code=0, job="100", max_restarts=3, **kw):
    gs.begin(run_dir, job)
    if status:
        write_exit(run_dir, status, exit_code=exit_code, reason=kw.pop("reason", None))
    return gs.decide(run_dir, exit_code, max_restarts, job, **kw)


def test_finished_is_done(tmp_path):
    action, message = attempt(tmp_path, "finished")
    assert action == "done" and "finished at step 10" in message


def test_checkpointed_requeues_without_counting(tmp_path):
    for _ in range(5):  # preemptions and time limits are not failures: never bounded
        action, _ = attempt(tmp_path, "checkpointed", exit_code=75, reason="deadline")
        assert action == "requeue"
    assert json.loads((tmp_path / "slurm" / "state.json").read_text())["failures"] == 0
    action, message = attempt(tmp_path, "checkpointed", exit_code=75, reason="SIGUSR1", requeue=False)
    assert action == "stop" and "SIGUSR1" in message
    assert attempt(tmp_path, "checkpointed", exit_code=75, mode="local")[0] == "stop"


def test_failures_are_bounded(tmp_path):
    actions = [attempt(tmp_path, "failed", exit_code=1, reason="RuntimeError: boom")[0] for _ in range(4)]
    assert actions == ["requeue", "requeue", "requeue", "give-up"]  # default --max-restarts 3
    log = [json.loads(line) for line in (tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()]
    assert [r["failures"] for r in log] == [1, 2, 3, 4]
    assert log[-1]["reason"] == "RuntimeError: boom" and log[-1]["action"] == "give-up"


def test_the_state_is_written_whole_under_this_process_own_temp_name(tmp_path, monkeypatch):
    """Two jobs on one run dir each write their own temp file (a shared name let one job rename the
    other's half-written file); the data is on disk before the rename."""
    other = tmp_path / "slurm" / ".state.json.1.tmp"  # another job's write in progress
    other.parent.mkdir()
    other.write_text("{half")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(gs.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    attempt(tmp_path, "checkpointed", exit_code=75)
    assert synced  # flushed to disk before os.replace
    assert json.loads((tmp_path / "slurm" / "state.json").read_text())["failures"] == 0
    assert other.read_text() == "{half"  # not this job's to touch
    names = sorted(p.name for p in other.parent.iterdir())
    assert names == [".state.json.1.tmp", "attempts.jsonl", "state.json"]  # no temp file of this job left


def test_a_checkpointed_attempt_resets_the_failure_count(tmp_path):
    assert attempt(tmp_path, "failed", exit_code=1, max_restarts=1)[0] == "requeue"
    assert attempt(tmp_path, "checkpointed", exit_code=75, max_restarts=1)[0] == "requeue"
    assert attempt(tmp_path, "failed", exit_code=1, max_restarts=1)[0] == "requeue"
    assert attempt(tmp_path, "failed", exit_code=1, max_restarts=1)[0] == "give-up"


def test_a_new_job_gets_its_own_budget(tmp_path):
    assert attempt(tmp_path, "failed", exit_code=1, max_restarts=0, job="1")[0] == "give-up"
    assert attempt(tmp_path, "failed", exit_code=1, max_restarts=1, job="2")[0] == "requeue"


def test_config_errors_are_not_retried(tmp_path):
    action, message = attempt(tmp_path, "failed", exit_code=2, reason="LayoutError: tp")
    assert action == "give-up" and "not retried" in message


def test_stale_last_exit_is_not_this_attempts(tmp_path):
    """A crash that left no last_exit.json must not be read as the previous attempt's 'checkpointed'."""
    assert attempt(tmp_path, "checkpointed", exit_code=75)[0] == "requeue"
    action, message = attempt(tmp_path, None, exit_code=137)  # killed: nothing written this time
    assert action == "requeue" and "exit code 137" in message
    log = (tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()
    assert json.loads(log[-1])["status"] == "failed"
    assert json.loads(log[-1])["source"] == "exit code"


def test_exit_code_fallback_without_last_exit(tmp_path):
    """Under srun a task's exit code survives: 0 finished, 75 checkpointed (under torchrun 75 is lost)."""
    assert attempt(tmp_path, None, exit_code=0)[0] == "done"
    assert attempt(tmp_path, None, exit_code=75)[0] == "requeue"
    assert attempt(tmp_path, None, exit_code=75, mode="local", job="200")[0] == "requeue"  # a failure there


def test_a_recorded_stop_is_checkpointed_whatever_srun_returned(tmp_path):
    """Rank 0 writes its record before any rank leaves the final barrier; a task still exiting after that
    may be killed by ``srun --kill-on-bad-exit`` (srun returns 137, or 143 for a SIGTERM): still a
    checkpointed stop, requeued without spending the restart budget. Both exit codes are logged."""
    for step_code in (137, 143):
        gs.begin(tmp_path, "100")
        write_exit(tmp_path, "checkpointed", reason="SIGUSR1", exit_code=75)
        action, message = gs.decide(tmp_path, step_code, 0, "100")
        assert action == "requeue" and "checkpointed at step 10 (reason: SIGUSR1)" in message
        last = json.loads((tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()[-1])
        assert (last["status"], last["exit_code"], last["step_exit_code"]) == ("checkpointed", 75, step_code)
        assert last["source"] == "last_exit.json" and last["failures"] == 0
    # the same kill before rank 0 wrote (the order this guards against): no fresh record, a failure
    assert attempt(tmp_path, None, exit_code=137, max_restarts=0)[0] == "give-up"


def test_an_nccl_timeout_is_named_with_its_flight_recorder_dumps(tmp_path):
    """NCCL's watchdog tears a process down without Python running: no record says why, but the flight
    recorder's dumps (<run_dir>/nccl_trace_rank_<r>) are there; the attempt record names them. Dumps of
    an earlier attempt, and files that only look alike, are not this attempt's."""
    (tmp_path / "nccl_trace_rank_3").write_bytes(b"an earlier attempt's")
    gs.begin(tmp_path, "100")
    (tmp_path / "nccl_trace_rank_1").write_bytes(b"dump")
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"dump")
    (tmp_path / "nccl_trace_rank_2.pipe").write_bytes(b"")
    action, message = gs.decide(tmp_path, 134, 3, "100")  # SIGABRT from the watchdog, no last_exit.json
    assert action == "requeue" and "a collective timed out (NCCL's watchdog" in message
    last = json.loads((tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["status"] == "failed" and last["failures"] == 1
    assert last["nccl_dumps"] == [str(tmp_path / "nccl_trace_rank_0"), str(tmp_path / "nccl_trace_rank_1")]
    assert f"rank(s) 0, 1 at {tmp_path}/nccl_trace_rank_<rank>" in last["reason"]

    # a rank that recorded a failure of its own: the dumps are added to its reason
    gs.begin(tmp_path, "100")
    write_exit(tmp_path, "failed", reason="RuntimeError: NCCL communicator was aborted", exit_code=1)
    (tmp_path / "nccl_trace_rank_3").write_bytes(b"this attempt's dump")
    gs.decide(tmp_path, 1, 3, "100")
    last = json.loads((tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["reason"].startswith("RuntimeError: NCCL communicator was aborted; a collective timed out")
    assert last["nccl_dumps"] == [str(tmp_path / "nccl_trace_rank_3")]

    # nothing new: nothing named; a finished attempt is finished
    gs.begin(tmp_path, "100")
    write_exit(tmp_path, "finished")
    assert gs.decide(tmp_path, 0, 3, "100")[0] == "done"
    last = json.loads((tmp_path / "slurm" / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["nccl_dumps"] == []


def test_nccl_dumps_without_a_snapshot_count_from_the_attempt_start(tmp_path):
    """A state file written before dumps were snapshotted: a dump modified after the attempt started is
    this attempt's, an older one is not."""
    (tmp_path / "slurm").mkdir()
    started = 1_700_000_000.0
    state = {"job_id": "100", "failures": 0, "last_exit_before": None, "attempt_started": started}
    (tmp_path / "slurm" / "state.json").write_text(json.dumps(state))
    for rank, mtime in ((0, started - 60), (1, started + 600)):
        dump = tmp_path / f"nccl_trace_rank_{rank}"
        dump.write_bytes(b"dump")
        os.utime(dump, (mtime, mtime))
    assert gs.fresh_nccl_dumps(tmp_path, state) == [tmp_path / "nccl_trace_rank_1"]


def test_train_sbatch_keeps_fa4_kernels_on_disk_unless_the_site_chose(tmp_path):
    """FA4's compile cache is on (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1) in a node-local directory
    (GOAT_SCRATCH, else /tmp), exported to every step; what the site file or the submitting shell set
    wins. Seen by the first command the script runs (the run-dir helper, here a stand-in)."""
    seen = tmp_path / "seen.env"
    python = tmp_path / "python"
    python.write_text(
        f"#!/bin/sh\nenv | grep -E '^(FLASH_ATTENTION_CUTE_DSL|GOAT_PRIVATE)' | sort > {seen}\nexit 2\n"
    )
    python.chmod(0o755)

    def exported(site: str = "", **env) -> dict:
        (tmp_path / "site.env").write_text(site)
        theirs = ("SLURM_", "FLASH_ATTENTION_", "GOAT_")  # this shell's own choices would hide the defaults
        base = {k: v for k, v in os.environ.items() if not k.startswith(theirs)}
        base.update(SLURM_JOB_ID="1", GOAT_PYTHON=str(python), GOAT_SITE_ENV=str(tmp_path / "site.env"))
        out = subprocess.run(
            ["bash", "slurm/train.sbatch", "configs/tiny.yaml"],
            env={**base, **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and seen.exists(), out.stderr
        return dict(line.split("=", 1) for line in seen.read_text().splitlines())

    scratch = tmp_path / "scratch"
    assert exported(GOAT_SCRATCH=str(scratch)) == {
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": f"{scratch}/fa4-cache",
    }
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    assert exported() == {  # in /tmp: a directory of this user's alone, checked by every task
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": f"/tmp/goat-dist-{user}/fa4-cache",
        "GOAT_PRIVATE_DIR": f"/tmp/goat-dist-{user}",
    }
    site = "export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/shared/fa4\n"
    site += "export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0\n"
    assert exported(site, GOAT_SCRATCH=str(scratch)) == {
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/shared/fa4",
    }
    from_login = exported(FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="/login/fa4")
    assert from_login["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == "/login/fa4"


def test_decide_cli(tmp_path):
    helper = [sys.executable, str(ROOT / "slurm" / "goat_slurm.py")]
    subprocess.run([*helper, "begin", str(tmp_path), "--job-id", "9"], check=True, timeout=60)
    write_exit(tmp_path, "checkpointed", reason="SIGUSR1", exit_code=75)
    out = subprocess.run(
        [*helper, "decide", str(tmp_path), "--exit-code", "1", "--job-id", "9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "requeue"
    assert "checkpointed at step 10 (reason: SIGUSR1)" in out.stderr


def test_run_dir_resolution(tmp_path):
    helper = [sys.executable, str(ROOT / "slurm" / "goat_slurm.py")]
    out = subprocess.run(
        [*helper, "run-dir", str(ROOT / "configs" / "tiny.yaml"), "run.name=abc"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "runs" / "abc")
    bad = subprocess.run(
        [*helper, "run-dir", str(ROOT / "configs" / "tiny.yaml"), "train.nope=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "train.nope" in bad.stderr


# ---- the scripts' argument handling (no Slurm needed) -----------------------------------------------------
def _bash(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(env_extra or {})
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_train_sbatch_outside_slurm_says_so():
    out = _bash(["slurm/train.sbatch", "configs/tiny.yaml"])
    assert out.returncode == 2 and "not inside a Slurm job" in out.stderr


def test_train_sbatch_rejects_bad_options():
    assert "unknown option --bogus" in _bash(["slurm/train.sbatch", "--bogus", "configs/tiny.yaml"]).stderr
    out = _bash(["slurm/train.sbatch", "--max-restarts", "x", "configs/tiny.yaml"])
    assert out.returncode == 2 and "--max-restarts must be" in out.stderr


def test_chain_requires_a_count():
    out = _bash(["slurm/chain.sh", "zero", "slurm/train.sbatch"])
    assert out.returncode == 2 and "N must be a positive integer" in out.stderr


def test_sweep_needs_an_array():
    out = _bash(["slurm/sweep.sbatch", "slurm/sweeps/positions.txt", "configs/tiny.yaml"])
    assert out.returncode == 2 and "not an array job" in out.stderr


def test_scripts_are_strict_bash():
    for path in ("slurm/train.sbatch", "slurm/sweep.sbatch", "slurm/chain.sh", "launch/local.sh"):
        text = (ROOT / path).read_text()
        assert "set -euo pipefail" in text, path
        assert "eval " not in text, path
        assert subprocess.run(["bash", "-n", str(ROOT / path)], timeout=30).returncode == 0, path
    header = (ROOT / "slurm" / "train.sbatch").read_text()
    for directive in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@"):
        assert directive in header


def test_signal_constant_matches_trainer():
    from goat_dist.trainer.signals import EXIT_CHECKPOINTED

    assert gs.EXIT_CHECKPOINTED == EXIT_CHECKPOINTED
    assert signal.SIGUSR1  # the signal the scripts forward exists here


def test_train_sbatch_raises_the_open_files_limit_and_says_so(tmp_path):
    """A soft nofile limit below the hard one (Slurm propagates the submitting shell's) is raised to the
    hard one, with a log line; the script then goes on (here it stops at the missing config)."""
    import resource

    def low_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    env = {**os.environ, "SLURM_JOB_ID": "1", "GOAT_PYTHON": sys.executable, "GOAT_SITE_ENV": "/nonexistent"}
    proc = subprocess.run(
        ["bash", "slurm/train.sbatch", str(tmp_path / "missing.yaml")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=low_soft_limit,
    )
    out = proc.stdout + proc.stderr
    assert "open files limit raised from 256 to 4096" in out, out
    assert proc.returncode == 2, out


def test_own_steps_leave_array_siblings_alone():
    """Element 2 of array 6 got the array's id (job 6): ``squeue -s -j 6`` lists every element's steps, and
    ending all of them killed element 0's preflight and element 1's training. Only its own are ended."""
    listed = ["6_0.0", "6_1.1", "6_2.1", "6_2.batch", "6_2.extern", "6.0"]
    env = {"SLURM_JOB_ID": "6", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "2"}
    assert gs.own_steps(listed, env) == ["6_2.1", "6.0"]
    env = {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "0"}
    assert gs.own_steps(listed + ["9.3"], env) == ["6_0.0", "9.3"]
    assert gs.own_steps(["12.0", "12.batch", "120.0", "1.0"], {"SLURM_JOB_ID": "12"}) == ["12.0"]
