"""``rehearse``: the whole rehearsal of a config at a world size, and its report."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..config import Config
from ..plan.hardware import GIB
from . import volumes
from .rank import Fault, RankRun, RehearsalError, conditional_faults, partner_rank, rehearse_rank, sync_faults
from .step import rehearsal_config


@dataclass
class Rehearsal:
    """The rehearsal of one rank (``run``) checked against another (``partner``), with its findings."""

    name: str
    world: int
    layers: int
    full_layers: int
    cfg: Config
    run: RankRun
    partner: RankRun | None
    faults: list[Fault] = field(default_factory=list)
    documented_syncs: dict = field(default_factory=dict)
    volumes: dict = field(default_factory=dict)  # group -> (recorded, analytical) ring bytes per step
    memory: list[dict] = field(default_factory=list)  # planned vs traced, by term
    seconds: float = 0.0

    def count(self, kind: str) -> int:
        return sum(1 for f in self.faults if f.kind == kind)

    @property
    def syncs_per_step(self) -> int:
        return sum(self.run.syncs.values())

    @property
    def clean(self) -> bool:
        return not self.faults

    def peak(self, which: str) -> float | None:
        row = next((r for r in self.memory if r["term"] == "total"), None)
        return None if row is None else row[which]

    def last_line(self) -> str:
        traced, planned = self.peak("traced"), self.peak("planned")
        memory = (
            f"traced peak {traced / GIB:.2f} GiB vs planned {planned / GIB:.2f} GiB ({traced / planned:.2f})"
            if traced and planned
            else "memory not traced"
        )
        return (
            f"rehearsal: {self.name} world {self.world} rank {self.run.rank}: "
            f"{self.count('placement')} placement faults, {self.syncs_per_step} host syncs per step, "
            f"{self.count('kernel refusal')} kernel refusals, {memory}"
        )


def rehearse(
    cfg: Config,
    world: int,
    gpu,
    *,
    rank: int | None = None,
    layers: int | None = None,
    name: str = "config",
    memory: bool = True,
    compare: bool = True,
) -> Rehearsal:
    """Rehearse rank ``rank`` (default: the last rank, which holds the most: the last TP, CP and DP rank)
    of ``world`` ranks of ``cfg`` on ``gpu`` (``plan.hardware.GPU``), cut to ``layers`` blocks; compare
    its collectives with another rank's (``compare``) and trace its memory (``memory``)."""
    t0 = time.perf_counter()
    rank = world - 1 if rank is None else rank
    if not 0 <= rank < world:
        raise RehearsalError(f"--rank {rank} is not a rank of a world of {world}")
    full_layers = cfg.model.num_layers
    cut = rehearsal_config(cfg, layers)
    run = rehearse_rank(cut, rank, world, gpu)
    partner = None
    faults = list(run.faults)
    if compare and world > 1 and not run.faults:
        partner = rehearse_rank(cut, partner_rank(rank, world), world, gpu)
        faults += [f for f in partner.faults if f.kind != "step error"] or conditional_faults(run, partner)
    more, documented = sync_faults(cut, run.syncs)
    faults += more
    lay = run.layout
    recorded = volumes.recorded(run.calls)
    expected = volumes.analytical(cut, lay.tp, lay.cp, lay.dp, run.grad_accum)
    table = {g: (recorded.get(g, 0.0), expected.get(g)) for g in sorted(set(recorded) | set(expected))}
    out = Rehearsal(
        name, world, cut.model.num_layers, full_layers, cut, run, partner, faults, documented, table
    )
    if memory and not run.faults:
        from .memory import compare_with_plan, trace_memory

        out.memory = compare_with_plan(cut, world, trace_memory(cut, rank, world))
    out.seconds = time.perf_counter() - t0
    return out


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:10.3f}"


def format_rehearsal(r: Rehearsal) -> str:
    """The report: the rank, its collectives by group against the analytical volume, host syncs, memory,
    every fault, and the last line."""
    run, lay, c = r.run, r.run.layout, r.cfg
    lines = [
        f"rehearsal    {r.name}: rank {run.rank} of {r.world} (TP {lay.tp} x CP {lay.cp} x DP {lay.dp}; "
        f"tp_rank {lay.tp_rank}, dp_rank {lay.dp_rank}), {r.layers} of {r.full_layers} layers, "
        f"{c.train.precision}, ZeRO-{c.parallel.zero_stage}, attention {run.backend or '?'}, "
        f"{run.grad_accum} micro-batches of {c.train.micro_batch_size}; {r.seconds:.1f} s",
        "collectives  per step, this rank (group, op, dtype, where in the step: calls, bytes)",
    ]
    kinds: Counter = Counter()
    sizes: Counter = Counter()
    for call in run.calls:
        key = (call.group, call.op, call.dtype, call.phase)
        kinds[key] += 1
        sizes[key] += call.bytes
    for key in sorted(kinds):
        group, op, dtype, phase = key
        lines.append(
            f"  {group:<9s} {op:<23s} {dtype:<9s} {phase:<9s} {kinds[key]:6d} calls {sizes[key]:>16,d} B"
        )
    lines.append("wire GB      per step, this rank: recorded  analytical  ratio")
    for group, (got, want) in r.volumes.items():
        ratio = f"{got / want:6.3f}" if want else "     -"
        lines.append(f"  {group:<10s} {_gb(got)} {_gb(want)}  {ratio}")
    designed = sum(v for k, v in run.syncs.items() if k.rsplit(":", 1)[0] == "goat_dist/trainer/control.py")
    lines.append(f"host syncs   {r.syncs_per_step} per step: {designed} designed (the control agreement)")
    for where, count in r.documented_syncs.items():
        lines.append(f"  {where}: {count} (data.document_masking documents this cost: docs/gpu.md)")
    if r.memory:
        lines.append("memory GiB   term               planned     traced   ratio")
        for row in r.memory:
            ratio = f"{row['traced'] / row['planned']:6.2f}" if row.get("planned") else "     -"
            note = f"  {row['note']}" if row.get("note") else ""
            lines.append(
                f"  {row['term']:<24s} {row['planned'] / GIB:9.3f} {row['traced'] / GIB:10.3f}  {ratio}{note}"
            )
    for fault in r.faults:
        lines.append(f"FAULT        {fault}")
    lines.append(r.last_line())
    return "\n".join(lines)
