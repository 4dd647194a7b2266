"""One rank's training step at the real world size, with the accelerator stood in, checked for
the faults a CPU run over gloo cannot show (``goat_dist.rehearsal``'s docstring lists them)."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from ..config import Config
from ..distributed import Layout
from . import step as steps
from .standin import HostSyncs, accelerator_on_meta
from .world import RECORDER, Collective, caller, fake_world

# the step's designed host read: the control agreement's (trainer/control.py), once per step
DESIGNED_SYNCS = {"goat_dist/trainer/control.py": 1}
# host reads a feature documents as its cost (docs/gpu.md), by the files that make them
DOCUMENTED_SYNCS = {
    "data.document_masking": ("goat_dist/kernels/masks.py", "goat_dist/kernels/chunks.py"),
}
FAULT_KINDS = (
    "placement",
    "host sync",
    "kernel refusal",
    "host tensor on an NCCL group",
    "rank-conditional collective",
    "step error",
)


class RehearsalError(RuntimeError):
    """The rehearsal itself could not run (a bad rank, a config the planner refuses): exit 2, named."""


@dataclass
class Fault:
    kind: str  # one of FAULT_KINDS
    where: str  # file:line of the goat_dist frame at fault
    what: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}: {self.what}"


@dataclass
class RankRun:
    """What one rank's rehearsed step did."""

    rank: int
    layout: Layout
    grad_accum: int
    calls: list[Collective] = field(default_factory=list)
    syncs: Counter = field(default_factory=Counter)
    faults: list[Fault] = field(default_factory=list)
    backend: str = ""
    seconds: float = 0.0

    def sequence(self) -> list[tuple]:
        return [c.signature() for c in self.calls]


def fault_site(error: BaseException) -> str:
    """``file:line`` of the innermost project frame of ``error``'s traceback (``world.caller``)."""
    frames = traceback.extract_tb(error.__traceback__)
    return caller(frames) if frames else "?"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def classify(error: BaseException) -> Fault:
    """A step's exception as the fault it shows: a kernel refusal (the stand-in's), a placement fault (a
    host tensor meeting a device one), else an error of the step."""
    from .kernels import KernelRefusal

    if isinstance(error, KernelRefusal):
        kind = "kernel refusal"
    elif "device" in str(error) or "meta" in str(error):
        kind = "placement"
    else:
        kind = "step error"
    return Fault(kind, fault_site(error), _first_line(error))


def sync_faults(cfg: Config, syncs: Counter, steps_run: int = 1) -> tuple[list[Fault], dict[str, int]]:
    """Host reads beyond the design (faults) and those a configured feature documents (returned by line)."""
    allowed = [f for key, files in DOCUMENTED_SYNCS.items() if _enabled(cfg, key) for f in files]
    faults, documented = [], {}
    for where, count in sorted(syncs.items()):
        file = where.rsplit(":", 1)[0]
        if file in DESIGNED_SYNCS and count <= DESIGNED_SYNCS[file] * steps_run:
            continue
        if file in allowed:
            documented[where] = count
            continue
        faults.append(Fault("host sync", where, f"{count} host read(s) per step (the designed number: 1, the "
                                                 "control agreement's)"))  # fmt: skip
    return faults, documented


def _enabled(cfg: Config, key: str) -> bool:
    section, name = key.split(".")
    return bool(getattr(getattr(cfg, section), name))


def kernel_of(model, cfg: Config) -> str:
    """The attention kernel the model's blocks run at the config's precision (``auto`` resolved)."""
    import torch

    if not len(model.blocks):
        return ""
    return model.blocks[0].attn.kernel_for(torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)


def rehearse_rank(cfg: Config, rank: int, world: int, gpu) -> RankRun:
    """Rank ``rank`` of ``world``'s step (``cfg`` from ``step.rehearsal_config``) on ``gpu``
    (``plan.hardware.GPU``): built, run once, recorded."""
    from ..trainer.trainer import gradient_accumulation
    from .kernels import kernels_of

    t0 = time.perf_counter()
    answers = {"tolist": steps.control_answer}
    p = cfg.parallel
    with contextlib.ExitStack() as stack:
        layout = stack.enter_context(fake_world(rank, world, p.tp, p.cp))
        stack.enter_context(accelerator_on_meta(gpu.capability))
        stack.enter_context(kernels_of(gpu.capability))
        run = RankRun(rank, layout, gradient_accumulation(cfg, layout.dp))
        syncs = stack.enter_context(HostSyncs(answers))
        try:
            model, engine = steps.build_rank(cfg, layout)
            run.backend = kernel_of(model, cfg)
            steps.run_step(steps.trainer_for(cfg, layout, engine, run.grad_accum), run.grad_accum)
        except Exception as error:  # a fault stops the step: report it, with where it happened
            run.faults.append(classify(error))
        run.calls = list(RECORDER.calls)
    run.syncs = syncs.counts
    hosts = Counter(c for c in run.calls if c.host_on_nccl)
    for c, count in hosts.items():
        what = f"{count} {c.op} of a host {c.dtype} tensor on the {c.group} group (NCCL only on a CUDA run)"
        run.faults.append(Fault("host tensor on an NCCL group", c.where, what))
    run.seconds = time.perf_counter() - t0
    return run


def conditional_faults(mine: RankRun, other: RankRun) -> list[Fault]:
    """Collectives one rank makes and another does not (or makes differently): the first difference of
    the two ranks' recorded sequences, which on a GPU hangs every rank of the group. Named at the call one
    rank makes beyond the other's sequence when there is one, else at this rank's."""
    a, b = mine.calls, other.calls
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x is not None and y is not None and x.signature() == y.signature():
            continue
        extra = x
        if x is None or (y is not None and i + 1 < len(b) and b[i + 1].signature() == x.signature()):
            extra = y  # the other rank's call is the one this rank never makes
        what = f"collective {i + 1}: rank {mine.rank} makes {_call(x)}, rank {other.rank} makes {_call(y)}"
        where = (extra or x or y).where  # type: ignore[union-attr]  # one of them is a call
        return [Fault("rank-conditional collective", where, what)]
    return []


def _call(c: Collective | None) -> str:
    return "nothing" if c is None else f"{c.op} ({c.group}, {c.dtype}, {c.bytes:,} B at {c.where})"


def partner_rank(rank: int, world: int) -> int:
    """The rank compared with ``rank``: rank 0 (the first of every group and the main rank), or the last
    rank when ``rank`` is 0."""
    return 0 if rank != 0 else world - 1
