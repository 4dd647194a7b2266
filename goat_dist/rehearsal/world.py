"""One rank of a large world in this process, every collective recorded instead of sent.

A process-group backend of our own (``rehearse``) stands in for NCCL: each collective any code makes (ours,
megatron-core's, whatever function object it captured at import) reaches ``RecordingGroup``, which writes
down the group, the op, the dtype, the bytes, the device of the tensor and the goat_dist line that asked,
and returns at once. Nothing travels and no value changes, which is all a rehearsal on the meta device
needs. torch's own ``fake`` backend does the same without the record.

A CUDA run's groups are all NCCL-only (``distributed.backend_for``): a host tensor is refused there unless
it reaches the world group through ``goat_dist.collectives``, which copies it to the device (the few
host-side values). The recorder holds every other group to that rule (``Collective.host_on_nccl``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private
from torch.futures import Future

from .. import distributed

BACKEND = "rehearse"
PACKAGE_MARK = "goat_dist"
# frames that never name a fault: the rehearsal's own and the kernel stand-ins' (the fault is the call)
OWN_FILES = (
    "goat_dist/rehearsal/",
    "goat_dist/kernels/flash4_standin.py",
    "goat_dist/kernels/flash_standin.py",
    "goat_dist/kernels/refusal.py",
)


def caller(frames=None) -> str:
    """``file:line`` of the innermost frame of the project's code (not torch's, megatron's or the
    rehearsal's own): the line that made the call, or that called the library that made it."""
    frames = traceback.extract_stack()[:-1] if frames is None else frames
    ours = [f for f in frames if _project_frame(f.filename)]
    frame = ours[-1] if ours else frames[-1]
    return f"{short_path(frame.filename)}:{frame.lineno}"


def _project_frame(filename: str) -> bool:
    library = "site-packages" in filename or "/lib/python3" in filename or filename.startswith("<")
    return not library and not any(own in filename for own in OWN_FILES)


def short_path(filename: str) -> str:
    """A frame's file as a reader finds it: from ``goat_dist/`` on, else relative to the working
    directory when under it."""
    i = filename.rfind(PACKAGE_MARK + "/")
    if i >= 0:
        return filename[i:]
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


@dataclass(frozen=True)
class Collective:
    """One collective as the rank made it."""

    group: str  # the layout's name for it: world, tp, cp, dp, replicas (dp x cp), or "ranks a-b"
    size: int  # ranks in the group
    op: str
    dtype: str
    bytes: int  # this rank's input buffer (an all-gather: its shard; a reduce-scatter: the whole input)
    device: str
    where: str  # file:line of the goat_dist frame that made it
    phase: str = ""  # set by the rehearsal: forward, backward, engine, control

    @property
    def host_on_nccl(self) -> bool:
        """A host tensor on a group that is NCCL-only on a CUDA run, other than the world's. Every group is
        NCCL-only there; on the world group host values are expected (checkpoint decisions, start records,
        log-step gathers) and reach NCCL through ``goat_dist.collectives``, which copies them to the device
        for a group that serves only CUDA (here every group also serves the CPU, so nothing is copied), or
        through torch's object collectives, which place their bytes on the device themselves."""
        return self.device == "cpu" and self.group != "world"

    def signature(self) -> tuple:
        """What every rank of the group must agree on: the sequence of these."""
        return (self.group, self.op, self.dtype, self.bytes)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends for it in a ring (NCCL's bus traffic): an all-reduce 2(n-1)/n of the
        buffer, a reduce-scatter or all-to-all (n-1)/n of its input, an all-gather (n-1) x its shard, a
        broadcast the buffer."""
        n = self.size
        if n <= 1:
            return 0.0
        if self.op == "all_reduce":
            return 2 * (n - 1) / n * self.bytes
        if self.op in ("all_gather_into_tensor", "all_gather"):
            return (n - 1) * self.bytes
        if self.op == "broadcast":
            return float(self.bytes)
        return (n - 1) / n * self.bytes


class Recorder:
    """The collectives of this rank, in order, and the phase the rehearsal is in."""

    def __init__(self):
        self.calls: list[Collective] = []
        self.phase = ""
        self.names: dict[int, str] = {}  # id(group) -> name

    def name_of(self, group) -> str:
        name = self.names.get(id(group))
        if name is None:
            ranks = dist.get_process_group_ranks(group)
            name = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        return name

    def add(self, group, op: str, tensors) -> None:
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        first = tensors[0] if tensors else None
        self.calls.append(
            Collective(
                group=self.name_of(group),
                size=group.size(),
                op=op,
                dtype=str(first.dtype).removeprefix("torch.") if first is not None else "-",
                bytes=sum(t.numel() * t.element_size() for t in tensors),
                device=first.device.type if first is not None else "-",
                where=caller(),
                phase=self.phase,
            )
        )

    @contextlib.contextmanager
    def phase_of(self, name: str):
        before, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = before


RECORDER = Recorder()  # the backend's groups write here (one rehearsal at a time per process)


def _done(result=None):
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class RecordingGroup(dist.ProcessGroup):
    """A process group whose collectives are recorded and return at once (see the module docstring)."""

    def getBackendName(self) -> str:
        return BACKEND

    def _record(self, op, tensors, result):
        RECORDER.add(self, op, tensors)
        return _done(result)

    # the overrides take what the C++ dispatcher passes; the stubs declare narrower option types
    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        return self._record("all_reduce", tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._record("all_reduce", tensors, tensors)

    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        return self._record("broadcast", tensors, tensors)

    def allgather(self, outputs, inputs, opts=None):
        return self._record("all_gather", inputs, outputs)

    def all_gather_single(self, output, input, opts=None):
        return self._record("all_gather_into_tensor", [input], output)

    def reduce_scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        flat = [t for ts in inputs for t in ts]
        return self._record("reduce_scatter", flat, outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._record("reduce_scatter_tensor", [input], output)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._record("all_to_all_single", [input], output)

    def barrier(self, opts=None):
        return self._record("barrier", [], None)


def _create(store, rank, world_size, timeout):
    return RecordingGroup(rank, world_size)  # type: ignore[call-arg]  # (rank, size) at run time


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
        _registered = True


@contextlib.contextmanager
def fake_world(rank: int, world: int, tp: int, cp: int = 1, device: torch.device | None = None):
    """Rank ``rank`` of a world of ``world`` processes, with megatron's TP/CP/DP groups as
    ``distributed.init`` makes them; yields its ``distributed.Layout`` (on ``device``, default meta) and
    records every collective into ``RECORDER`` (cleared first)."""
    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process without a torch.distributed world")
    _register()
    RECORDER.calls.clear()
    try:
        layout = distributed.init_fake(rank, world, tp, cp, backend=BACKEND)
        layout = dataclasses.replace(layout, device=device or torch.device("meta"))
        RECORDER.names = {
            id(dist.group.WORLD): "world",
            id(layout.tp_group): "tp",
            id(layout.cp_group): "cp",
            id(layout.dp_group): "dp",
            id(layout.replica_group): "replicas",
        }
        if cp == 1:
            RECORDER.names[id(layout.replica_group)] = "dp"  # the same ranks: DP
        yield layout
    finally:
        distributed.teardown_fake()
        RECORDER.names = {}
