"""Asynchronous checkpoint writes (``checkpoint.async=true``): stage to host memory, write in the background.

The training loop pauses only while a save's tensors are copied to host memory (on GPUs: a device-to-host
copy into pinned buffers, reused from one save to the next); a background thread then writes the files,
fsyncs each and records its sha256 (hashed as written, or read back for files written by another
function), so publishing need not hash it again (``digests.digest_files``). Training continues meanwhile.

- The state (``stage_universal``): this rank's own pieces of the fp32 masters and Adam moments
  (``universal.own_pieces``), copied into host buffers: the pause is the copy of the rank's own share,
  with no collective but the small gather of the piece lists. The thread writes them as one
  safetensors file, hashing as it writes (``tensor_file``).
- The RNG states are captured (already copies) and written by the thread; ``trainer_state.json``,
  ``config.yaml`` and ``universal/index.json`` are small and written at once.

A checkpoint counts only when the manager publishes it (manifest, then ``latest``), which it does only
after every rank's writer finished (``CheckpointManager.poll`` / ``wait``); a crash while writes are in
flight leaves the previous checkpoint ``latest``.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from pathlib import Path

import torch

from .digests import digest
from .space import write_failure

__all__ = ["BackgroundWriter", "HostBuffers", "host_copy", "stage", "stage_universal"]


class HostBuffers:
    """Host buffers for staging, pinned on CUDA and reused by the next save once its write finished (a
    pinned allocation costs more than the copy). On CPU nothing is kept: the buffers are freed after the
    write, so a CPU run holds a second copy of its state only while a save is in flight."""

    def __init__(self):
        self.pin = torch.cuda.is_available()
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()
        self.in_use: list = []

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            pool = self._free.get(nbytes)
            if pool:
                buf = pool.pop()
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
        self.in_use.append(buf)
        return buf

    def release(self) -> None:
        """The write of everything taken so far finished: keep pinned buffers for the next save."""
        with self._lock:
            if self.pin:
                for buf in self.in_use:
                    self._free.setdefault(buf.nbytes(), []).append(buf)
            self.in_use = []


def _stage_tensor(t: torch.Tensor, memo: dict, buffers: HostBuffers) -> torch.Tensor:
    storage = t.untyped_storage()
    key = (str(storage.device), storage.data_ptr(), storage.nbytes())
    host = memo.get(key)
    if host is None:
        host = buffers.take(storage.nbytes())
        host.copy_(storage, non_blocking=buffers.pin)
        memo[key] = host
    out = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def stage(obj, buffers: HostBuffers | None = None, memo: dict | None = None):
    """A copy of ``obj`` (nested dicts, lists, tuples, objects) whose tensors live in host memory and no
    longer change with training. Tensors sharing storage share the copy (whole storages are copied, as
    ``torch.save`` writes whole storages). Call ``synchronize()`` before reading the copies on CUDA."""
    buffers = buffers or HostBuffers()
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        return _stage_tensor(obj, memo, buffers)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type (OrderedDict, a defaultdict's factory)
        for k, v in obj.items():
            out[k] = stage(v, buffers, memo)
        return out
    if isinstance(obj, list):
        return [stage(v, buffers, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [stage(v, buffers, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, complex, torch.dtype, torch.device)):
        return obj
    try:  # anything else (DeepSpeed's config, loss scaler, enums): its state now, not after more steps
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is written as it is
        return obj


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_copy(t: torch.Tensor, buffers: HostBuffers) -> torch.Tensor:
    """A contiguous host copy of ``t`` alone (not its whole storage)."""
    t = t.detach()
    host = buffers.take(t.numel() * t.element_size())
    out = torch.empty(0, dtype=t.dtype).set_(host, 0, t.shape)
    out.copy_(t, non_blocking=buffers.pin)
    return out


class BackgroundWriter:
    """One thread writing queued files in order. Each job writes one file, fsyncs it and records its size
    and sha256 (read back from disk), keyed by its name relative to the checkpoint directory;
    ``events("file_written", step_dir, name)`` hears of it, on this thread (``CheckpointManager``)."""

    def __init__(self, step_dir: Path, buffers: HostBuffers | None = None, events=None, describe=None):
        """``describe(step_dir, path, error)``: the message for a failed write (default: ``space``'s,
        which names the directory and the bytes needed and free on a full disk)."""
        self.step_dir = Path(step_dir)
        self.describe = describe or (lambda step_dir, path, error: write_failure(path, step_dir, error))
        self.digests: dict[str, dict] = {}
        self.error = ""
        self.buffers = buffers or HostBuffers()
        self.events = events
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._written = 0
        self.bytes = 0
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._thread = threading.Thread(target=self._run, name="goat-ckpt-writer", daemon=True)

    def start(self) -> None:
        """Begin writing what was queued (after staging: the writes do not compete with the staging copies
        and collectives for the CPU while the training loop is paused)."""
        self._thread.start()

    def submit(self, path: Path, write) -> None:
        """Queue ``write(path)``, which creates the file and may return its digest (``{bytes, sha256}``
        of what it wrote, fsynced); otherwise the file is fsynced and read back to hash it."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put((Path(path), write))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            path, write = job
            try:
                if not self.error:
                    written = write(path)
                    if not isinstance(written, dict):
                        with open(path, "rb+") as f:
                            os.fsync(f.fileno())
                        written = digest(path)
                    name = str(path.relative_to(self.step_dir))
                    self.digests[name] = written
                    self.bytes += self.digests[name]["bytes"]
                    self._written += 1
                    if self.events is not None:
                        self.events("file_written", self.step_dir, name)
            except BaseException as e:  # noqa: BLE001 - reported to every rank when the save is finished
                self.error = self.describe(self.step_dir, path, e)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self.finished = time.perf_counter()
                        self._idle.set()

    def done(self) -> bool:
        """Every queued file is written (or a write failed)."""
        return self._idle.is_set()

    def wait(self) -> None:
        self._idle.wait()

    def close(self) -> None:
        """After ``wait``: end the thread, give the staging buffers back (pinned ones are reused)."""
        self._jobs.put(None)
        self.buffers.release()


def _write_torch(obj, zipfile: bool):
    def write(path: Path) -> None:
        with open(path, "wb") as f:  # a file object: a write failure is an OSError, not torch's own
            torch.save(obj, f, _use_new_zipfile_serialization=zipfile)

    return write


def queue_torch_save(writer: BackgroundWriter, obj, path: Path, zipfile: bool = True) -> None:
    """Stage ``obj`` and queue its ``torch.save`` to ``path``."""
    staged = stage(obj, writer.buffers)
    synchronize()
    writer.submit(path, _write_torch(staged, zipfile))


def stage_universal(engine, model, step_dir: Path, step: int, writer: BackgroundWriter) -> None:
    """Collective: ``universal.save`` with this rank's pieces copied to host buffers now and its file
    queued on ``writer`` (rank 0's ``index.json`` is written now)."""
    from . import universal

    def submit(path: Path, write) -> None:
        synchronize()  # the device-to-host copies are complete before the thread reads them
        writer.submit(path, write)

    universal.save(
        engine,
        model,
        step_dir,
        step,
        to_host=lambda t: host_copy(t.detach().float(), writer.buffers),
        submit=submit,
    )
