"""``goat-dist plan --search``: every layout the trainer accepts on a cluster, the ones that fit, fastest
first.

For the config's model, sequence length and global batch on ``nodes`` x ``gpus_per_node`` GPUs it
enumerates TP over the divisors of a node's GPUs, SP with TP, CP over the divisors of what TP leaves,
ZeRO 0-3, activation checkpointing none, selective and full, and every micro-batch that divides the
global batch over DP (the accumulation follows). A candidate is kept only when the trainer's own checks
pass (``config.validate``, ``distributed.check_layout``, ``check_batch``, ``check_rampup``) and the
planner says it fits (memory and construction within the budget, ``planner.memory_at``,
``construction_at``); the kept ones are ranked by the planner's tokens/s (``planner.throughput``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from ..config import Config, ConfigError, validate
from ..distributed import LayoutError, check_batch, check_layout, check_rampup
from .hardware import GIB, GPU
from .memory import _cp, state_bytes
from .planner import budget, construction_at, layout_of, memory_at, planned_config, throughput

CHECKPOINTING = ("none", "selective", "full")


@dataclass
class Candidate:
    tp: int
    sp: bool
    cp: int
    zero_stage: int
    checkpointing: str
    micro_batch: int
    dp: int
    grad_accum: int
    memory: dict = field(repr=False)
    construction: dict = field(repr=False)
    budget: int = 0
    throughput: dict = field(default_factory=dict, repr=False)
    own: bool = False  # the config's own layout

    @property
    def key(self) -> tuple:
        return (self.tp, self.sp, self.cp, self.zero_stage, self.checkpointing, self.micro_batch)

    @property
    def peak(self) -> int:
        return max(self.memory["total"], self.construction["total"])

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    def overrides(self) -> list[str]:
        """The config keys that select this layout (``goat-dist train`` / ``plan`` overrides)."""
        return [
            f"parallel.tp={self.tp}",
            f"parallel.sp={'true' if self.sp else 'false'}",
            f"parallel.cp={self.cp}",
            f"parallel.zero_stage={self.zero_stage}",
            f"train.activation_checkpointing={self.checkpointing}",
            f"train.micro_batch_size={self.micro_batch}",
        ]

    def why(self) -> str:
        """Why it fits (or not), in GiB per GPU: the budget against its terms."""
        mem, g = self.memory, lambda n: f"{n / GIB:.1f}"
        what = (
            f"state {g(mem['state']['total'])} + activations {g(mem['activations']['total'])} + transient "
            f"{g(mem['transient']['total'])} + reserved {g(mem['reserved'])} = {g(mem['total'])}; "
            f"built at {g(self.construction['total'])}"
        )
        verdict = "fits" if self.fits else "does not fit"
        return f"{verdict} {g(self.peak)} of {g(self.budget)} GiB: {what}"


def own_key(cfg: Config) -> tuple:
    t, p = cfg.train, cfg.parallel
    return (p.tp, p.sp, _cp(cfg), p.zero_stage, t.activation_checkpointing, t.micro_batch_size)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configured(base: Config, tp: int, sp: bool, cp: int, stage: int, ac: str, micro: int) -> Config:
    c = copy.copy(base)
    c.parallel = copy.copy(base.parallel)
    c.train = copy.copy(base.train)
    c.parallel.tp, c.parallel.sp, c.parallel.cp, c.parallel.zero_stage = tp, sp, cp, stage
    c.train.activation_checkpointing, c.train.micro_batch_size = ac, micro
    return c


def trainer_accepts(cfg: Config, world: int) -> str | None:
    """None when the trainer would start ``cfg`` on ``world`` ranks, else its refusal: the config's checks,
    the layout's and the batch's, as ``Trainer.__init__`` runs them."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    try:
        validate(cfg)
        check_layout(world, p.tp, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len, p.sp, cp=p.cp)
        dp = world // (p.tp * p.cp)
        check_batch(t.global_batch_size, t.micro_batch_size, dp)
        check_rampup(t.global_batch_size, t.micro_batch_size, dp, t.batch_rampup, m.seq_len)
    except (ConfigError, LayoutError) as e:
        return str(e)
    return None


def enumerate_layouts(cfg: Config, world: int, gpus_per_node: int):
    """Every (tp, sp, cp, zero stage, checkpointing, micro-batch) the trainer accepts for ``cfg`` (as
    planned: ``planner.planned_config``) on ``world`` ranks, as configs."""
    base = planned_config(cfg)
    t = base.train
    for tp in divisors(min(gpus_per_node, world)):
        for sp in (False, True) if tp > 1 else (False,):
            for cp in divisors(world // tp):
                dp = world // (tp * cp)
                if t.global_batch_size % dp:
                    continue  # no micro-batch divides it: check_batch refuses every one
                for micro in divisors(t.global_batch_size // dp):
                    for stage in range(4):
                        for ac in CHECKPOINTING:
                            c = _configured(base, tp, sp, cp, stage, ac, micro)
                            if trainer_accepts(c, world) is None:
                                yield c


def search(cfg: Config, nodes: int, gpus_per_node: int, gpu: GPU, top: int = 5) -> dict:
    """The ``top`` fastest layouts that fit, the config's own layout's place, and counts."""
    start = time.perf_counter()
    world = nodes * gpus_per_node
    cap = budget(gpu)
    own = own_key(planned_config(cfg))
    accepted = 0
    fitting: list[Candidate] = []
    own_candidate = None
    # memory grows with the micro-batch (at one accumulation setting): once one does not fit, the larger
    # ones at the same layout are skipped unless their accumulation differs (one micro-batch a step drops
    # the fp32 accumulation buffers)
    too_big: dict[tuple, int] = {}
    states: dict[tuple, dict] = {}  # state and construction bytes: the same at every micro-batch and CP
    built: dict[tuple, dict] = {}
    for c in enumerate_layouts(cfg, world, gpus_per_node):
        accepted += 1
        lay = layout_of(c, world)
        replicas = lay["dp"] * lay["cp"]
        accum = int(lay["grad_accum"])
        p, t = c.parallel, c.train
        shape = (p.tp, p.sp, p.cp, p.zero_stage, t.activation_checkpointing, accum == 1)
        key = (p.tp, p.sp, p.cp, p.zero_stage, t.activation_checkpointing, t.micro_batch_size)
        if shape in too_big and t.micro_batch_size > too_big[shape] and key != own:
            continue
        if (p.tp, p.zero_stage, replicas) not in built:
            built[p.tp, p.zero_stage, replicas] = construction_at(c, replicas)
        build = built[p.tp, p.zero_stage, replicas]
        mem = _memory(c, replicas, accum, states) if build["total"] <= cap else _unbuilt(build)
        cand = Candidate(p.tp, p.sp, p.cp, p.zero_stage, t.activation_checkpointing, t.micro_batch_size,
                         lay["dp"], accum, mem, build, cap, own=key == own)  # fmt: skip
        if not cand.fits:
            too_big[shape] = min(too_big.get(shape, t.micro_batch_size), t.micro_batch_size)
        if cand.fits or cand.own:
            cand.throughput = throughput(c, lay, gpu, gpus_per_node)
        if cand.own:
            own_candidate = cand
        if cand.fits:
            fitting.append(cand)
    fitting.sort(key=lambda c: (-c.throughput["tokens_per_s"], c.peak))
    rank = next((i + 1 for i, c in enumerate(fitting) if c.own), None)
    refusal = None
    if own_candidate is None:
        refusal = trainer_accepts(planned_config(cfg), world) or "not enumerated"
    return {
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "world": world,
        "gpu": gpu.name,
        "budget": cap,
        "accepted": accepted,
        "fitting": len(fitting),
        "best": fitting[:top],
        "own": own_candidate,
        "own_rank": rank,
        "own_refusal": refusal,
        "seconds": time.perf_counter() - start,
    }


def _memory(c: Config, replicas: int, accum: int, states: dict) -> dict:
    """``planner.memory_at``, its state kept across candidates that hold the same: the state depends on the
    micro-batch only through whether there is accumulation."""
    key = (c.parallel.tp, c.parallel.zero_stage, replicas, accum > 1)
    if key not in states:
        states[key] = state_bytes(c, replicas)
    return memory_at(c, replicas, c.train.micro_batch_size, state=states[key])


def _unbuilt(build: dict) -> dict:
    """A layout whose model cannot be built: no training memory counted (it never starts)."""
    zero = {"total": 0}
    return {"state": zero, "activations": zero, "transient": zero, "reserved": 0, "total": 0}


def _row(i: str, c: Candidate, best_tps: float) -> str:
    th = c.throughput
    sp = "+SP" if c.sp else ""
    layout = f"TP{c.tp}{sp} CP{c.cp} DP{c.dp} ZeRO-{c.zero_stage} ac={c.checkpointing}"
    return (
        f"{i:>4} {layout:<34} {c.micro_batch:>5} x {c.grad_accum:<4} {th['tokens_per_s']:>12,.0f} "
        f"{th['tokens_per_s'] / best_tps:>6.1%} {th['step_s']:>7.3f} {th['mfu']:>6.1%} "
        f"{c.peak / GIB:>7.1f}{'  <- config' if c.own else ''}"
    )


def format_search(r: dict) -> str:
    lines = [
        f"search       {r['nodes']} node(s) x {r['gpus_per_node']} {r['gpu']} = {r['world']} GPUs: "
        f"{r['accepted']} layouts the trainer accepts, {r['fitting']} fit the "
        f"{r['budget'] / GIB:.1f} GiB budget ({r['seconds']:.1f} s)",
    ]
    if not r["best"]:
        return "\n".join([*lines, "no layout fits"])
    best_tps = r["best"][0].throughput["tokens_per_s"]
    lines += [
        "",
        f"{'rank':>4} {'layout':<34} {'micro':>5} x {'acc':<4} {'tokens/s':>12} {'vs 1':>6} "
        f"{'step s':>7} {'MFU':>6} {'GiB/GPU':>7}",
    ]
    for i, c in enumerate(r["best"]):
        lines.append(_row(str(i + 1), c, best_tps))
    own = r["own"]
    if own is not None and not any(c.own for c in r["best"]):
        lines.append(_row(str(r["own_rank"]) if r["own_rank"] else "-", own, best_tps))
    lines.append("")
    for i, c in enumerate(r["best"]):
        th = c.throughput
        lines.append(
            f"{i + 1}. {' '.join(c.overrides())}\n   {c.why()}\n   step {th['step_s']:.3f} s = "
            f"matmuls {th['compute_s']:.3f} + memory-bound {th['memory_bound_s']:.3f} + TP "
            f"{th['tp_comm_s']:.3f} + CP {th['cp_comm_s']:.3f} + DP exposed {th['dp_comm_s']:.3f} (of "
            f"{th['dp_total_s']:.3f}: "
            f"{th['dp_schedule']}) + optimizer {th['optimizer_s']:.3f}"
        )
    if own is None:
        lines.append(f"config's layout: refused by the trainer: {r['own_refusal']}")
    elif not own.fits:
        lines.append(f"config's layout: {own.why()}")
    elif not any(c.own for c in r["best"]):
        lines.append(f"config's layout: rank {r['own_rank']} of {r['fitting']}; {own.why()}")
    return "\n".join(lines)
