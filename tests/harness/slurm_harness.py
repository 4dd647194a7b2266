"""A real one-node Slurm (Debian's 22.05 + munge) on localhost, for the Slurm end-to-end tests.

``SlurmCluster().start()`` is idempotent: it starts munged, slurmctld and slurmd only when they are not
running already, remembers which ones it started, and ``stop()`` ends only those (by their pid). The
configuration, state, spool and logs live in one private directory (``GOAT_SLURM_HARNESS_DIR``, default
``/tmp/goat-slurm-harness``); clients find it through ``SLURM_CONF`` (``cluster.env()``), so an existing
``/etc/slurm`` is never touched. Settings that matter here:

* ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: the cgroup plugins fail silently in
  containers without systemd;
* ``SlurmctldHost=<short hostname>(127.0.0.1)``, ``NodeAddr=127.0.0.1``, ``RealMemory`` from ``slurmd -C``;
* ``SlurmdParameters=config_overrides``: the node advertises more CPUs than exist (concurrent small jobs);
* ``AuthInfo=cred_expire=10`` and ``SchedulerParameters=sched_interval=1``: a requeued job starts again
  ~11 s later instead of ~160 s;
* private ports (``GOAT_SLURM_PORTS``, default 6917/6918), so a real Slurm on the host is not disturbed.

Installing Slurm is not done here (``.ci/run`` does it: ``apt-get install slurm-wlm munge``);
``unavailable()`` says why a machine cannot run the tests, and the tests skip with that reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "squeue")
ADVERTISED_CPUS = 8


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def unavailable() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}); "
            "`apt-get install -y --no-install-recommends slurm-wlm munge` (.ci/run does) enables these tests"
        )
    if os.geteuid() != 0:
        return "the local Slurm test cluster needs root (munged runs as user munge, slurmd as root)"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def parse_job_record(line: str) -> dict[str, str]:
    """``scontrol show job -o`` output (one line of ``Key=value`` pairs; values may contain spaces)."""
    fields: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields[m.group(1)] = line[m.end() : end].strip()
    return fields


class SlurmCluster:
    def __init__(self, base: str | Path | None = None):
        self.base = Path(base or os.environ.get("GOAT_SLURM_HARNESS_DIR", "/tmp/goat-slurm-harness"))
        self.conf = self.base / "slurm.conf"
        ports = os.environ.get("GOAT_SLURM_PORTS", "6917,6918").split(",")
        self.ctld_port, self.slurmd_port = int(ports[0]), int(ports[1])
        self.host = socket.gethostname().split(".")[0]
        self.started: dict[str, int] = {}  # daemon -> pid, only those this object started

    # ---- configuration ----------------------------------------------------------------------------
    def env(self, **extra) -> dict:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env.update(extra)
        return env

    def _real_memory(self) -> int:
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"RealMemory=(\d+)", out)
        return max(1, int(m.group(1)) - 512) if m else 1024

    def write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        b = self.base
        text = f"""# written by tests/harness/slurm_harness.py: a one-node test cluster on localhost
ClusterName=goattest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
InactiveLimit=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={ADVERTISED_CPUS} RealMemory={self._real_memory()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        if not self.conf.is_file() or self.conf.read_text() != text:
            self.conf.write_text(text)

    # ---- daemons ----------------------------------------------------------------------------------
    def _munge_ok(self) -> bool:
        try:
            cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
            if cred.returncode:
                return False
            check = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10)
            return check.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _start_munge(self) -> None:
        if self._munge_ok():
            return
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.is_file():
            subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True, timeout=30)
        subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], check=True, timeout=30)
        self._wait(self._munge_ok, 15, "munged did not come up")
        pid = _read_pid(run_dir / "munged.pid")
        if pid:
            self.started["munged"] = pid

    def _ping(self) -> bool:
        try:
            out = subprocess.run(
                ["scontrol", "ping"], env=self.env(), capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return "is UP" in out.stdout

    def _node_state(self) -> str:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().lower()

    def _start_daemon(self, name: str, args: list[str], pid_file: Path) -> None:
        if _read_pid(pid_file):
            return
        subprocess.run([_which(name), "-f", str(self.conf), *args], env=self.env(), check=True, timeout=60)
        self._wait(lambda: _read_pid(pid_file) is not None, 20, f"{name} did not start (see {self.base}/log)")
        self.started[name] = _read_pid(pid_file)

    def start(self) -> SlurmCluster:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.write_config()
        self._start_munge()
        self._start_daemon("slurmctld", [], self.base / "slurmctld.pid")
        self._wait(self._ping, 30, f"slurmctld does not answer (see {self.base}/log/slurmctld.log)")
        self._start_daemon("slurmd", [], self.base / "slurmd.pid")

        def node_ready() -> bool:
            state = self._node_state()
            if "down" in state or "drain" in state:
                subprocess.run(
                    ["scontrol", "update", f"nodename={self.host}", "state=resume"],
                    env=self.env(),
                    capture_output=True,
                    timeout=10,
                )
            return state in ("idle", "mixed", "allocated")

        self._wait(node_ready, 60, f"node never became idle (see {self.base}/log/slurmd.log)")
        return self

    def stop(self) -> None:
        """Cancel the jobs still in this cluster (``cancel_all``), then stop the daemons this object
        started (slurmd, slurmctld, munged), by pid; nothing else."""
        daemons = [self.started.get(name) for name in ("slurmctld", "slurmd")]
        try:
            if all(pid is not None and _alive(pid) for pid in daemons):
                self.cancel_all()
        finally:
            self._stop_daemons()

    def _stop_daemons(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.started.pop(name, None)
            if pid is None or not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def queued(self) -> list[str]:
        """The ids of the jobs in this cluster's queue (all of them are this machine's tests': the cluster
        is private)."""
        proc = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0:
            raise RuntimeError(f"squeue: {proc.stderr.strip()}")
        return proc.stdout.split()

    def cancel_all(self, timeout: float = 90) -> None:
        """Cancel every job of this private cluster and wait until the queue is empty. A job step
        (slurmstepd) outlives slurmd: a test that failed before cancelling its job would otherwise leave
        it training, on a 2-core machine, through the tests after it. Waits past KillWait (30 s)."""
        jobs = self.queued()
        if not jobs:
            return
        subprocess.run(["scancel", *jobs], env=self.env(), capture_output=True, timeout=30)
        self._wait(lambda: not self.queued(), timeout, f"jobs {jobs} still queued after scancel")

    @staticmethod
    def _wait(predicate, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.3)
        raise RuntimeError(message)

    # ---- jobs -------------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | Path | None = None) -> int:
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stdout}{proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def scontrol(self, *args: str, check: bool = True, tries: int = 1) -> str:
        """``scontrol args``; a query (``tries`` > 1) is repeated while it fails: on a loaded machine the
        controller sometimes answers late, and a poll must not end a test for that."""
        for attempt in range(tries):
            try:
                proc = subprocess.run(
                    ["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30
                )
            except subprocess.TimeoutExpired as e:
                proc = subprocess.CompletedProcess(e.cmd, 1, "", "timed out")
            if proc.returncode == 0 or attempt == tries - 1:
                break
            time.sleep(1)
        if check and proc.returncode:
            raise RuntimeError(
                f"scontrol {' '.join(args)}: exit {proc.returncode} {proc.stdout}{proc.stderr}"
            )
        return proc.stdout

    def job(self, job_id: int) -> dict[str, str]:
        return parse_job_record(self.scontrol("show", "job", "-o", str(job_id), tries=10).strip())

    def array_jobs(self, array_job_id: int) -> list[dict[str, str]]:
        """All elements of a job array, one record each."""
        out = self.scontrol("show", "job", "-o", str(array_job_id), tries=10)
        return [parse_job_record(line) for line in out.splitlines() if line.strip()]

    def signal_batch(self, job_id: int, sig: str = "USR1") -> None:
        """What Slurm's ``--signal=B:USR1@N`` does before a time limit, but at once."""
        for _ in range(3):  # a second signal is harmless; a lost one would fail the test
            proc = subprocess.run(
                ["scancel", f"--signal={sig}", "--batch", str(job_id)],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if proc.returncode == 0:
                return
            time.sleep(1)
        raise RuntimeError(f"scancel --signal={sig} --batch {job_id}: {proc.stderr}")

    def cancel(self, *job_ids: int) -> None:
        subprocess.run(["scancel", *map(str, job_ids)], env=self.env(), capture_output=True, timeout=30)

    def wait_array(self, array_job_id: int, timeout: float = 300) -> list[dict[str, str]]:
        """Poll until every element of a job array has ended; their records, by array index."""
        deadline = time.monotonic() + timeout
        elements: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            elements = self.array_jobs(array_job_id)
            if elements and all(e.get("JobState") in TERMINAL for e in elements):
                return sorted(elements, key=lambda e: int(e.get("ArrayTaskId", "0")))
            time.sleep(0.5)
        self.cancel(array_job_id)
        states = [(e.get("JobId"), e.get("JobState")) for e in elements]
        raise TimeoutError(f"job array {array_job_id} not done after {timeout:.0f}s: {states}")

    def wait(self, job_id: int, timeout: float = 300, states=TERMINAL) -> dict[str, str]:
        """Poll until the job is in one of ``states``; returns its record."""
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in states:
                return record
            time.sleep(0.5)
        self.cancel(job_id)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f}s: {json.dumps(record)}")
