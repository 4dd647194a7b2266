"""The logic behind slurm/train.sbatch and launch/local.sh, kept out of shell so it can be tested.

Subcommands (``python slurm/goat_slurm.py <cmd> ...``):

``exec -- CMD...``
    Run inside every ``srun`` task: map Slurm's task layout to torch.distributed's environment
    (``RANK`` <- ``SLURM_PROCID``, ``LOCAL_RANK`` <- ``SLURM_LOCALID``, ``WORLD_SIZE`` <- ``SLURM_NTASKS``,
    ``MASTER_ADDR`` <- first host of the node list, ``MASTER_PORT`` derived from the job id), then exec CMD.
    SIGUSR1 and SIGTERM are set to "ignore" before the exec, so a stop request that arrives before the
    trainer installs its handlers (or after it removed them, during the final save) cannot kill the task,
    nor its DataLoader workers (Slurm signals every process of a step); the batch script repeats the
    request until the step ends, and Slurm's SIGKILL after KillWait remains the last word.
    ``GOAT_PRIVATE_DIR`` (set by train.sbatch when FA4's kernel cache defaults to /tmp): made ``0700`` on
    this node, or checked to be this user's alone; otherwise the cache is off for the task
    (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0``), since FA4 loads compiled code from it.
``run-dir CONFIG [OVERRIDES...]``
    Print the absolute run directory that ``goat-dist train`` will use.
``port``
    Print the rendezvous port of this job (``GOAT_MASTER_PORT`` if set).
``env``
    Print, as ``KEY=VALUE`` lines, what the job script (and launch/local.sh) exports before any training
    process starts: ``goat_dist.distributed.launch_environment`` of this environment (one CUDA
    connection, the allocator's expandable segments, NCCL's async error handling; a value already set,
    by the user or slurm/site.env, is kept and not printed).
``begin RUN_DIR``
    Before a training attempt: remember which ``last_exit.json`` and NCCL flight-recorder dumps (if any)
    are already there, so stale files from an earlier attempt are never read as this attempt's.
``decide RUN_DIR --max-restarts N --exit-code RC [--mode slurm|local] [--no-requeue]``
    After a training attempt: read the trainer's ``last_exit.json`` when this attempt wrote one, whatever
    the step's exit code (rank 0 writes it before any rank exits; ``srun --kill-on-bad-exit`` may still
    kill or signal the tasks left, and srun then returns 137 or 143), else fall back to the step's exit
    code; a record that still says ``running`` (the attempt's start record) is a killed attempt, failed;
    name NCCL flight-recorder dumps this attempt left (``<run_dir>/nccl_trace_rank_<r>``: a CUDA
    collective timed out and NCCL's watchdog tore the process down, with no Python left to say so); count
    consecutive failures of this job in ``RUN_DIR/slurm/state.json``, append the attempt to
    ``RUN_DIR/slurm/attempts.jsonl`` and print one word: ``done`` (finished), ``requeue`` (checkpointed by
    a signal or the deadline; or failed with restarts left), ``stop`` (checkpointed, requeue off),
    ``give-up`` (failed, no restarts left or not retryable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_CHECKPOINTED = 75  # goat_dist.trainer.signals.EXIT_CHECKPOINTED
EXIT_USAGE = 2  # goat-dist train: bad config or impossible layout; retrying cannot help
PORT_BASE, PORT_SPAN = 15000, 10000  # below Linux's ephemeral range (32768+)
LOG_PREFIX = "[goat-slurm]"
NCCL_DUMP = re.compile(r"nccl_trace_rank_(\d+)")  # goat_dist.distributed.NCCL_TRACE_PREFIX + the rank


class SlurmEnvError(RuntimeError):
    """The Slurm environment is incomplete or inconsistent; the message names the variable."""


# ---- node lists ---------------------------------------------------------------------------------------
def _split_top(expr: str) -> list[str]:
    """Split at commas outside brackets: ``a[1-2,4],b`` -> ``["a[1-2,4]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    parts.append(expr[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_ranges(body: str) -> list[str]:
    out = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            out.append(item)
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,07],gpu-a[1-2]-ib``) as host names, in order.

    The same as ``scontrol show hostnames``; used where scontrol is not available (and in tests)."""
    hosts: list[str] = []
    for part in _split_top(expr):
        m = re.search(r"\[([^\]]*)\]", part)
        if not m:
            hosts.append(part)
            continue
        head, tail = part[: m.start()], part[m.end() :]
        for value in _expand_ranges(m.group(1)):
            hosts += expand_hostlist(head + value + tail)
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """Host names of a Slurm node list: ``scontrol show hostnames`` when available, else our parser."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return expand_hostlist(nodelist)


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``4(x2),3``) -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise SlurmEnvError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


# ---- rendezvous -----------------------------------------------------------------------------------------
def derive_port(job_id: int, restart: int = 0, offset: int = 0) -> int:
    """A rendezvous port from the job id, in [15000, 25000): jobs sharing a first node rarely collide, and
    alternating with the restart count keeps a requeued attempt off the previous attempt's sockets.
    ``offset`` separates the preflight's port (1) from the training run's (0)."""
    return PORT_BASE + (job_id * 4 + (restart % 2) * 2 + offset) % PORT_SPAN


def _int(environ, name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise SlurmEnvError(f"{name} is not set: run this inside an srun task")
        return default
    try:
        return int(value)
    except ValueError as e:
        raise SlurmEnvError(f"{name}={value!r} is not an integer") from e


def _first(environ, *names: str) -> str | None:
    for name in names:
        if environ.get(name):
            return environ[name]
    return None


def torch_env(environ, hosts: list[str], offset: int = 0) -> dict[str, str]:
    """torch.distributed's environment for this srun task, from ``SLURM_*`` and the step's host list.

    One task per GPU: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` come straight from Slurm's task ids; the
    master is the first host (where Slurm places task 0)."""
    if not hosts:
        raise SlurmEnvError("empty host list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST)")
    rank = _int(environ, "SLURM_PROCID")
    local_rank = _int(environ, "SLURM_LOCALID")
    node_rank = _int(environ, "SLURM_NODEID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    job_id = _int(environ, "SLURM_JOB_ID")
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", len(hosts)))
    spec = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node = tasks_per_node(spec) if spec else [world // nnodes] * nnodes
    if len(hosts) != nnodes:
        raise SlurmEnvError(f"host list has {len(hosts)} hosts but the step has {nnodes} nodes: {hosts}")
    if len(per_node) != nnodes or sum(per_node) != world:
        raise SlurmEnvError(f"tasks per node {per_node} do not add up to {world} tasks on {nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise SlurmEnvError(f"SLURM_NODEID={node_rank} outside 0..{nnodes - 1}")
    if not 0 <= rank < world or not 0 <= local_rank < per_node[node_rank]:
        raise SlurmEnvError(
            f"task ids out of range: SLURM_PROCID={rank} of {world}, SLURM_LOCALID={local_rank} of "
            f"{per_node[node_rank]} on node {node_rank}"
        )
    me = environ.get("SLURMD_NODENAME")
    if me and me in hosts and hosts.index(me) != node_rank:
        raise SlurmEnvError(f"this node {me} is host #{hosts.index(me)} but SLURM_NODEID={node_rank}")
    explicit = environ.get("GOAT_MASTER_PORT")
    restart = _int(environ, "SLURM_RESTART_COUNT", 0)
    port = int(explicit) + offset if explicit else derive_port(job_id, restart, offset)
    return {
        "MASTER_ADDR": environ.get("GOAT_MASTER_ADDR") or hosts[0],
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(per_node[node_rank]),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
    }


def task_hosts(environ) -> list[str]:
    if environ.get("GOAT_SLURM_HOSTS"):
        return environ["GOAT_SLURM_HOSTS"].split()
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: run this inside an srun task")
    return hostnames(nodelist)


def private_dir_problem(path: Path) -> str | None:
    """None when ``path`` is a directory that only this user can write (made ``0700`` when absent), else
    why not: in a shared /tmp another user could have made it first, and filled it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cmd_exec(args: argparse.Namespace) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        print("goat_slurm.py exec: give a command after --", file=sys.stderr)
        return 2
    env = dict(os.environ)
    try:
        env.update(torch_env(env, task_hosts(env), offset=args.port_offset))
    except SlurmEnvError as e:
        print(f"{LOG_PREFIX} {e}", file=sys.stderr)
        return 2
    # torchrun's defaults, which a bare srun task lacks
    env.setdefault("OMP_NUM_THREADS", env.get("SLURM_CPUS_PER_TASK", "1"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if env.get("TMPDIR"):  # a per-job scratch dir made on the batch node only
        os.makedirs(env["TMPDIR"], exist_ok=True)
    if env.get("GOAT_PRIVATE_DIR"):
        problem = private_dir_problem(Path(env["GOAT_PRIVATE_DIR"]))
        if problem:
            env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
            if env.get("LOCAL_RANK") == "0":
                print(f"{LOG_PREFIX} FA4's kernel cache is off on this node: {problem}", file=sys.stderr)
    # Inherited through exec: a stop request cannot kill the task before the trainer installs its handlers
    # (or after it removed them, during the final save), and helper processes forked before that, such as
    # DataLoader workers, ignore them too: Slurm signals every process of a step, not just the task.
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    os.execvpe(cmd[0], cmd, env)
    return 0  # unreachable


def cmd_port(args: argparse.Namespace) -> int:
    env = os.environ
    port = env.get("GOAT_MASTER_PORT") or derive_port(
        _int(env, "SLURM_JOB_ID"), _int(env, "SLURM_RESTART_COUNT", 0)
    )
    print(port)
    return 0


def cmd_run_dir(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from goat_dist.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"goat-dist: {e}", file=sys.stderr)
        return 2
    print(cfg.run_dir.expanduser().resolve())
    return 0


def launch_env(environ) -> dict[str, str]:
    """``goat_dist.distributed.launch_environment`` (the one list of these values), imported from the
    checkout this script belongs to."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from goat_dist.distributed import launch_environment

    return launch_environment(environ)


def cmd_env(args: argparse.Namespace) -> int:
    for key, value in launch_env(os.environ).items():
        print(f"{key}={value}")
    return 0


# ---- outcome of an attempt and the requeue decision ---------------------------------------------------
@dataclass
class Outcome:
    status: str  # finished | checkpointed | failed
    reason: str | None
    step: int | None
    exit_code: int
    source: str  # "last_exit.json" or "exit code"


def _snapshot(path: Path) -> dict | None:
    try:
        st = path.stat()
        return {"mtime_ns": st.st_mtime_ns, "size": st.st_size, "text": path.read_text()}
    except OSError:
        return None


def _state_path(run_dir: Path) -> Path:
    return run_dir / "slurm" / "state.json"


def _read_state(run_dir: Path) -> dict:
    try:
        return json.loads(_state_path(run_dir).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: Path, state: dict) -> None:
    path = _state_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # this process's own temp name (two jobs on one run dir must not write one temp file), on disk before
    # the rename: a node that dies mid-write leaves the previous state.json whole
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(state, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def begin(run_dir: Path, job_id: str) -> dict:
    """Record the ``last_exit.json`` and NCCL dumps already present, so ``decide`` can tell fresh ones from
    stale ones."""
    state = _read_state(run_dir)
    if state.get("job_id") != job_id:  # a new job (not a requeue of the same one): its own restart budget
        state = {"job_id": job_id, "failures": 0}
    state["last_exit_before"] = _snapshot(run_dir / "last_exit.json")
    state["nccl_dumps_before"] = _dump_stamps(run_dir)
    state["attempt_started"] = time.time()
    _write_state(run_dir, state)
    return state


def _dump_stamps(run_dir: Path) -> dict[str, list[int]]:
    """NCCL flight-recorder dumps in the run dir: name -> [mtime_ns, size]."""
    stamps = {}
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return {}
    for path in entries:
        if NCCL_DUMP.fullmatch(path.name):
            try:
                st = path.stat()
            except OSError:
                continue
            stamps[path.name] = [st.st_mtime_ns, st.st_size]
    return stamps


def fresh_nccl_dumps(run_dir: Path, state: dict) -> list[Path]:
    """The flight-recorder dumps this attempt wrote (new or changed since ``begin``; without that
    snapshot, modified after the attempt started), in rank order."""
    now = _dump_stamps(run_dir)
    if "nccl_dumps_before" in state:
        before = state["nccl_dumps_before"] or {}
        fresh = [name for name, stamp in now.items() if before.get(name) != stamp]
    else:
        started_ns = int(float(state.get("attempt_started") or 0) * 1e9)
        fresh = [name for name, (mtime_ns, _) in now.items() if mtime_ns >= started_ns]
    return [run_dir / n for n in sorted(fresh, key=lambda n: int(NCCL_DUMP.fullmatch(n).group(1)))]


def nccl_timeout_reason(run_dir: Path, dumps: list[Path]) -> str:
    """What the attempt record says when NCCL's watchdog dumped its flight recorder."""
    ranks = ", ".join(NCCL_DUMP.fullmatch(p.name).group(1) for p in dumps)
    return (
        f"a collective timed out (NCCL's watchdog tore the process down): flight-recorder dumps of "
        f"rank(s) {ranks} at {run_dir}/nccl_trace_rank_<rank> (read them with `torchfrtrace {run_dir} "
        f"--prefix nccl_trace_rank_`)"
    )


def read_outcome(run_dir: Path, exit_code: int, before: dict | None, mode: str) -> Outcome:
    """This attempt's outcome: the trainer's ``last_exit.json`` if it wrote one during this attempt,
    whatever the step's exit code, otherwise the step's exit code (srun keeps a task's 75; under torchrun
    a worker's 75 becomes 1). A fresh record that still says ``running`` (written when the attempt
    started) is a killed attempt: failed, whatever the exit code.

    A fresh record is trusted over the exit code because rank 0 writes it before any rank leaves the
    final barrier: a step that srun ended with 137 or 143 after that (``--kill-on-bad-exit`` and a task
    still exiting) stopped where the record says. A ``latest`` checkpoint newer than the attempt is not
    taken as a checkpointed stop: a periodic save followed by a crash leaves one too, and a crash loop
    must spend the restart budget."""
    path = run_dir / "last_exit.json"
    now = _snapshot(path)
    if now is not None and now != before:
        try:
            data = json.loads(now["text"])
            if data.get("status") == "running":  # the attempt's start record, never replaced by its end
                return Outcome("failed", killed_reason(data), None, exit_code, "last_exit.json")
            if data.get("status") in ("finished", "checkpointed", "failed"):
                return Outcome(
                    data["status"],
                    data.get("reason"),
                    data.get("step"),
                    int(data.get("exit_code", exit_code)),
                    "last_exit.json",
                )
        except (ValueError, TypeError):
            pass
    if exit_code == 0:
        status = "finished"
    elif exit_code == EXIT_CHECKPOINTED and mode == "slurm":
        status = "checkpointed"
    else:
        status = "failed"
    reason = None if status == "finished" else f"exit code {exit_code}, no fresh last_exit.json"
    return Outcome(status, reason, None, exit_code, "exit code")


def killed_reason(record: dict) -> str:
    """What an attempt whose ``last_exit.json`` still says ``running`` was: its rank 0 never wrote how it
    ended, so something killed it (SIGKILL, the OOM killer, a node failure, NCCL's watchdog on CUDA)."""
    started = record.get("started")
    when = time.strftime("%F %T", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (
        f"killed: rank 0 (host {record.get('host')}, pid {record.get('pid')}, started {when}) ended without "
        "recording how (SIGKILL, out of memory, a node failure?)"
    )


def decide(
    run_dir: Path,
    exit_code: int,
    max_restarts: int,
    job_id: str,
    restart_count: int = 0,
    mode: str = "slurm",
    requeue: bool = True,
) -> tuple[str, str]:
    """(action, message) after an attempt; updates the failure count and the attempts log."""
    state = _read_state(run_dir)
    if state.get("job_id") != job_id:
        kept = ("last_exit_before", "nccl_dumps_before")
        state = {"job_id": job_id, "failures": 0, **{k: state[k] for k in kept if k in state}}
    outcome = read_outcome(run_dir, exit_code, state.get("last_exit_before"), mode)
    dumps = fresh_nccl_dumps(run_dir, state)
    if outcome.status == "failed" and dumps:
        hang = nccl_timeout_reason(run_dir, dumps)
        outcome.reason = hang if outcome.source == "exit code" else f"{outcome.reason}; {hang}"
    where = f"step {outcome.step}" if outcome.step is not None else "an unknown step"
    if outcome.status == "finished":
        action, message = "done", f"training finished at {where}"
    elif outcome.status == "checkpointed":
        what = f"checkpointed at {where} (reason: {outcome.reason or 'stop requested'})"
        if mode == "local":
            action, message = "stop", f"{what}; run the same command again to continue"
        elif requeue:
            action, message = "requeue", f"{what}; requeueing to continue"
        else:
            action, message = "stop", f"{what}; not requeued (requeue is off): the next job continues the run"
        state["failures"] = 0
    else:
        state["failures"] = int(state.get("failures", 0)) + 1
        n = state["failures"]
        what = f"training failed ({outcome.reason or 'no reason recorded'}; exit code {outcome.exit_code})"
        if outcome.exit_code == EXIT_USAGE:
            action, message = "give-up", f"{what}: a config or layout error, not retried"
        elif not requeue:
            action, message = "give-up", f"{what}; not requeued (requeue is off)"
        elif n > max_restarts:
            action = "give-up"
            message = f"{what}; {n} failed attempts in a row (--max-restarts={max_restarts}): giving up"
        else:
            action = "requeue"
            message = f"{what}; restart {n} of at most {max_restarts} (--max-restarts)"
    record = {
        "job_id": job_id,
        "restart_count": restart_count,
        "started": state.get("attempt_started"),
        "ended": time.time(),
        "status": outcome.status,
        "reason": outcome.reason,
        "step": outcome.step,
        "exit_code": outcome.exit_code,
        "step_exit_code": exit_code,
        "source": outcome.source,
        "nccl_dumps": [str(p) for p in dumps],
        "failures": state.get("failures", 0),
        "action": action,
    }
    log = run_dir / "slurm" / "attempts.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    state["last_exit_before"] = _snapshot(run_dir / "last_exit.json")
    state["nccl_dumps_before"] = _dump_stamps(run_dir)
    _write_state(run_dir, state)
    return action, message


def _job_id(args) -> str:
    return args.job_id or os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"


def own_steps(step_ids: list[str], environ) -> list[str]:
    """The steps (``<job>.<n>``, not ``batch``/``extern``) that belong to this job among ``squeue -s -j``'s.

    Slurm gives the first-started element of a job array the array's own id, and ``squeue -j <that id>``
    lists the steps of every element (``6_0.0``, ``6_1.1``, ...): a job script that ended every step it
    listed would kill its sibling elements' tasks. An element's own steps are ``<its job id>.<n>`` or
    ``<array id>_<its index>.<n>``."""
    prefixes = [f"{environ.get('SLURM_JOB_ID', '')}."]
    array_id, index = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_id and index:
        prefixes.append(f"{array_id}_{index}.")
    return [s for s in step_ids if s.startswith(tuple(prefixes)) and re.fullmatch(r"[0-9_]+\.[0-9]+", s)]


def cmd_steps(args: argparse.Namespace) -> int:
    """Print this job's running steps, one per line (none when squeue cannot be asked)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return 0
    try:
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    for step in own_steps(out.split(), os.environ):
        print(step)
    return 0


def cmd_begin(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    begin(run_dir, _job_id(args))
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    action, message = decide(
        Path(args.run_dir),
        args.exit_code,
        args.max_restarts,
        _job_id(args),
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0),
        mode=args.mode,
        requeue=not args.no_requeue,
    )
    prefix = "[goat-local]" if args.mode == "local" else LOG_PREFIX
    print(f"{prefix} {message}", file=sys.stderr)
    print(action)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="goat_slurm.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exec", help="map SLURM_* to torch.distributed's env and exec a command")
    e.add_argument("--port-offset", type=int, default=0, help="0: training, 1: preflight")
    e.add_argument("command", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_exec)
    sub.add_parser("port", help="this job's rendezvous port").set_defaults(func=cmd_port)
    sub.add_parser("env", help="KEY=VALUE lines the launcher exports").set_defaults(func=cmd_env)
    sub.add_parser("steps", help="this job's running steps (not its array siblings')").set_defaults(
        func=cmd_steps
    )
    r = sub.add_parser("run-dir", help="the absolute run dir of a config + overrides")
    r.add_argument("config")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(func=cmd_run_dir)
    b = sub.add_parser("begin", help="before an attempt")
    b.add_argument("run_dir")
    b.add_argument("--job-id")
    b.set_defaults(func=cmd_begin)
    d = sub.add_parser("decide", help="after an attempt: done | requeue | stop | give-up")
    d.add_argument("run_dir")
    d.add_argument("--exit-code", type=int, required=True)
    d.add_argument("--max-restarts", type=int, default=3)
    d.add_argument("--mode", choices=("slurm", "local"), default="slurm")
    d.add_argument("--no-requeue", action="store_true")
    d.add_argument("--job-id")
    d.set_defaults(func=cmd_decide)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
