"""The run dir's storage: writable from this node, and its write bandwidth (rank 0 times one process
writing and fsyncing a file), recorded for the trainer's deadline (``trainer/deadline.py``)."""

from __future__ import annotations

import math
import os
import shutil
import socket
import time
from pathlib import Path

from .report import Report, _human

WRITE_BANDWIDTH = "write_bandwidth.json"  # in <run_dir>/checkpoints/: the write check's measurement
WRITE_CHUNK = 8 * 2**20  # bytes per write() of the write check
MIN_WRITE_BYTES = 2**20  # below this (a nearly full disk) the write check is skipped


def check_run_dir_local(report: Report, run_dir: Path) -> bool:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".doctor-{socket.gethostname()}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"goat-dist doctor\n")
            f.flush()
            os.fsync(f.fileno())
        ok = probe.read_bytes() == b"goat-dist doctor\n"
        probe.unlink()
        if not ok:
            report.fail("run dir", f"{run_dir}: a file written there reads back differently")
        return ok
    except OSError as e:
        report.fail("run dir", f"{run_dir} is not writable: {e}")
        return False


def write_bandwidth_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / WRITE_BANDWIDTH


def measure_write_bandwidth(run_dir: Path, nbytes: int) -> dict:
    """One process writes ``nbytes`` to a temporary file in ``run_dir`` and fsyncs it: what a checkpoint
    writer gets from this file system. The file is deleted; the result is a dict (bytes, seconds, B/s)."""
    probe = run_dir / f".doctor-write-{socket.gethostname()}-{os.getpid()}"
    chunk = os.urandom(min(WRITE_CHUNK, nbytes))  # random: a compressing file system gains nothing
    try:
        started = time.perf_counter()
        with open(probe, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())
        seconds = max(time.perf_counter() - started, 1e-9)
    finally:
        probe.unlink(missing_ok=True)
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds,
            "host": socket.gethostname(), "run_dir": str(run_dir), "measured_at": time.time(),
            "method": "one process, sequential writes, fsync"}  # fmt: skip


def recorded_write_bandwidth(run_dir: Path) -> float | None:
    """The write bandwidth (B/s) the doctor recorded for ``run_dir``, or None (none, unreadable, corrupt)."""
    import json

    try:
        value = json.loads(write_bandwidth_path(run_dir).read_text())["bytes_per_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if value > 0 else None


def check_write_bandwidth(report: Report, run_dir: Path, nbytes: int) -> None:
    """Time a write of ``nbytes`` (at most a quarter of the free space) and record it in the run dir."""
    import json

    from ..atomic import atomic_write_text

    free = shutil.disk_usage(run_dir).free
    size = min(nbytes, free // 4) // 2**20 * 2**20
    if size < MIN_WRITE_BYTES:
        report.warn("write", f"not measured: {_human(free)} free on {run_dir}")
        return
    try:
        result = measure_write_bandwidth(run_dir, size)
        record = write_bandwidth_path(run_dir)
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        report.fail("write", f"writing {_human(size)} to {run_dir} failed: {e}")
        return
    report.ok(
        "write",
        f"{_human(size)} in {result['seconds']:.2f} s (one process, fsync): "
        f"{result['bytes_per_s'] / 1e6:.0f} MB/s; recorded in {record}",
    )
