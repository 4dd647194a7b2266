"""The time limit, seen coming: stop and save while there is still time for the save.

A run can have up to three wall-clock limits; the earliest counts:

* the Slurm job's end time when running under Slurm: ``SLURM_JOB_END_TIME`` (Slurm 23.02+ sets it;
  ``slurm/train.sbatch`` exports it on older versions), else asked once from Slurm with
  ``squeue -h -j $SLURM_JOB_ID -o "%A %e"`` (``SLURM_TIME_FORMAT=%s``: epoch seconds, no time-zone
  guessing; the line whose job id is ours, as ``-j`` of an array's id lists every element), else
  ``scontrol show job``. Only the first task of each node asks (``SLURM_LOCALID`` 0), so a big job
  does not flood the controller; the trainer folds ``due()`` over all ranks with a max anyway.
* ``train.stop_at``: an ISO 8601 time (``2026-12-01T06:00``, ``...Z`` or ``...+02:00``; no zone = local);
* ``train.time_limit_minutes``: minutes from the start of this process (0: off).

``due(step_seconds, save_seconds)`` is true once

    seconds_left < SAFETY x (step_seconds + save_seconds) + MARGIN_S

with ``SAFETY = 1.5`` (steps and saves vary: eval steps, a loaded file system) and ``MARGIN_S = 15`` s
(process teardown, writing ``last_exit.json``, the job script's requeue). Checked after every step, this
leaves room for one more step plus a save, with 50 % to spare. The save time is the run's last measured
save: this process's, or before its first one the last save an earlier attempt of the run recorded
(``checkpoints/save_cost.json``), so a requeued job budgets for its real save from its first step.

A run with no save yet estimates it as 5 s plus the bytes one node writes over one writer's bandwidth,
never below 10 s (and never below two steps):

* the checkpoint holds 12 B per parameter (fp32 masters and two Adam moments), and every rank writes only
  its share, so a node writes ``1 / nodes`` of it (``expect_checkpoint_bytes`` sets the whole size;
  ``from_config`` given the whole config computes it from the model; nodes: ``GROUP_WORLD_SIZE`` under
  torchrun, ``SLURM_NNODES`` under Slurm, else ``WORLD_SIZE / LOCAL_WORLD_SIZE``, else 1);
* the bandwidth is what ``goat-dist doctor`` measured for the run dir: one process writing and fsyncing
  (``checkpoints/write_bandwidth.json``), else a conservative 100 MB/s. One writer's bandwidth is taken as
  the node's: conservative within a node (its ranks share one stream), and it assumes that nodes write in
  parallel without slowing each other (what a parallel file system is built for; a slower one shows in the
  first measured save, which replaces this estimate).

``GOAT_DEADLINE_SAFETY`` / ``GOAT_DEADLINE_MARGIN_S`` override the two constants.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from datetime import datetime, timezone

SAFETY = 1.5
MARGIN_S = 15.0
FIRST_SAVE_MIN_S = 10.0  # the first save's estimate never goes below this
SAVE_OVERHEAD_S = 5.0  # fixed cost of a save: directories, manifest, fsyncs, barriers
WRITE_BYTES_PER_S = 100e6  # one writer's bandwidth when the doctor has not measured the run dir's
QUERY_TIMEOUT_S = 10.0
_FAR = 10 * 365 * 86400.0  # an "end time" this far away is Slurm's UNLIMITED


class DeadlineError(ValueError):
    """A deadline setting that cannot be parsed; the message names the key."""


def parse_time(text: str) -> float:
    """An ISO 8601 time or epoch seconds -> epoch seconds; naive times are local time."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    if text.endswith(("Z", "z")):  # datetime.fromisoformat only accepts 'Z' from Python 3.11 on
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text).timestamp()


def _slurm_end_time(environ, run=subprocess.run) -> float | None:
    """The running Slurm job's end time (epoch), or None (not under Slurm, no limit, Slurm unreachable)."""
    value = environ.get("SLURM_JOB_END_TIME")
    if value:
        try:
            return float(value)
        except ValueError:
            pass
    job = environ.get("SLURM_JOB_ID")
    if not job or environ.get("SLURM_LOCALID", "0") not in ("", "0"):
        return None
    env = {**environ, "SLURM_TIME_FORMAT": "%s"}
    queries = (
        (["squeue", "-h", "-j", job, "-o", "%A %e"], lambda out: _own_line(out, job)),
        (["scontrol", "show", "job", "-o", job], lambda out: _field(_own_record(out, job), "EndTime")),
    )
    for cmd, pick in queries:
        try:
            proc = run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, env=env)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode != 0:
            continue
        value = pick(proc.stdout or "")
        if not value or value.upper() in ("N/A", "UNKNOWN", "NONE", "INVALID"):
            continue
        try:
            return parse_time(value)
        except ValueError:
            continue
    return None


def _own_line(out: str, job: str) -> str | None:
    """squeue's ``%A %e`` line of this job. The id of an array's first-started element is also the array's
    id, and ``-j`` of it lists every element: the one whose own job id (``%A``) is ours is this job."""
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == job:
            return fields[1]
    return None


def _own_record(out: str, job: str) -> str:
    """scontrol's one-line record of this job (not another element of the array with the same id)."""
    return next((line for line in out.splitlines() if _field(line, "JobId") == job), "")


def _field(record: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){key}=(\S+)", record)
    return m.group(1) if m else None


def nodes_of(environ) -> int:
    """Nodes of this job: torchrun's ``GROUP_WORLD_SIZE``, Slurm's ``SLURM_NNODES``, else WORLD_SIZE over
    LOCAL_WORLD_SIZE, else 1 (anything unreadable counts as 1)."""
    for key in ("GROUP_WORLD_SIZE", "SLURM_NNODES"):
        value = environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(int(world) // int(local), 1)
    return 1


def _get(cfg, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


class Deadline:
    def __init__(
        self,
        end: float,
        source: str,
        now=time.time,
        safety: float = SAFETY,
        margin_s: float = MARGIN_S,
        checkpoint_bytes: int | None = None,
        write_bytes_per_s: float | None = None,
        nodes: int = 1,
    ):
        self.end = float(end)
        self.source = source
        self.now = now
        self.safety = safety
        self.margin_s = margin_s
        self.checkpoint_bytes = checkpoint_bytes
        self.write_bytes_per_s = write_bytes_per_s  # the doctor's measurement; None: WRITE_BYTES_PER_S
        self.nodes = max(int(nodes), 1)

    @classmethod
    def from_config(cls, train_cfg, environ=os.environ, now=time.time, run=subprocess.run) -> Deadline | None:
        """The earliest of the Slurm job's end, ``train.stop_at`` and ``train.time_limit_minutes``; None
        if there is none. ``train_cfg`` is the ``train`` section, or the whole ``Config`` (then the first
        save's time is estimated from the model's size)."""
        whole = train_cfg if hasattr(train_cfg, "train") and hasattr(train_cfg, "model") else None
        train = whole.train if whole is not None else train_cfg
        candidates: list[tuple[float, str]] = []
        slurm = _slurm_end_time(environ, run=run)
        if slurm is not None and slurm - now() < _FAR:
            candidates.append((slurm, f"Slurm job {environ.get('SLURM_JOB_ID')} end time"))
        stop_at = _get(train, "stop_at")
        if isinstance(stop_at, datetime):  # YAML reads an unquoted timestamp as a datetime
            candidates.append((stop_at.timestamp(), "train.stop_at"))
        elif stop_at:
            try:
                candidates.append((parse_time(str(stop_at)), "train.stop_at"))
            except ValueError as e:
                raise DeadlineError(f"train.stop_at={stop_at!r} is not an ISO 8601 time: {e}") from e
        minutes = float(_get(train, "time_limit_minutes", 0.0) or 0.0)
        if minutes < 0:
            raise DeadlineError(f"train.time_limit_minutes must be >= 0, got {minutes}")
        if minutes > 0:
            candidates.append((now() + 60.0 * minutes, f"train.time_limit_minutes={minutes:g}"))
        if not candidates:
            return None
        end, source = min(candidates)
        safety = float(environ.get("GOAT_DEADLINE_SAFETY") or SAFETY)
        margin = float(environ.get("GOAT_DEADLINE_MARGIN_S") or MARGIN_S)
        nbytes = bandwidth = None
        if whole is not None:
            try:
                from ..doctor import checkpoint_bytes, recorded_write_bandwidth

                nbytes = checkpoint_bytes(whole)
                bandwidth = recorded_write_bandwidth(whole.run_dir)
            except Exception:  # an estimate only; never let it stop a run
                nbytes = bandwidth = None
        return cls(end, source, now=now, safety=safety, margin_s=margin, checkpoint_bytes=nbytes,
                   write_bytes_per_s=bandwidth, nodes=nodes_of(environ))  # fmt: skip

    def expect_checkpoint_bytes(self, nbytes: int) -> None:
        """Size of one whole checkpoint (every rank's share together), for the first save's estimate."""
        self.checkpoint_bytes = int(nbytes)

    @property
    def write_bandwidth(self) -> float:
        """Bytes per second one writer gets: the doctor's measurement, else the conservative guess."""
        return self.write_bytes_per_s or WRITE_BYTES_PER_S

    def first_save_estimate(self, step_seconds: float = 0.0) -> float:
        """The first save's seconds: a node's share of the checkpoint at one writer's bandwidth + 5 s."""
        guess = FIRST_SAVE_MIN_S
        if self.checkpoint_bytes:
            per_node = self.checkpoint_bytes / self.nodes
            guess = max(guess, SAVE_OVERHEAD_S + per_node / self.write_bandwidth)
        return max(guess, 2.0 * step_seconds)

    def seconds_left(self) -> float:
        return self.end - self.now()

    def budget(self, step_seconds: float, save_seconds: float | None) -> float:
        """Seconds that must be left to run one more step and still save in time."""
        save = save_seconds if save_seconds and save_seconds > 0 else self.first_save_estimate(step_seconds)
        return self.safety * (max(step_seconds, 0.0) + save) + self.margin_s

    def due(self, step_seconds: float, save_seconds: float | None) -> bool:
        """True when the run must save and stop now (``save_seconds``: the last save's duration; 0 or None
        before the first save of this process)."""
        return self.seconds_left() < self.budget(step_seconds, save_seconds)

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.end, tz=timezone.utc).astimezone().isoformat(timespec="seconds")
        left = self.seconds_left()
        left_text = f"{left:.0f} s left" if math.isfinite(left) else "no limit"
        return f"deadline {when} ({self.source}; {left_text})"

    def __repr__(self) -> str:
        return f"Deadline({self.describe()})"
