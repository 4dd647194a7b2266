"""``goat-dist plan --materialize``: build the real model and optimizer of every rank of a large world on
one CPU box, without allocating a weight.

How: torch.distributed's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``: collectives
return at once) gives this process any rank of a world of any size; ``distributed.init_fake`` builds
megatron-core's TP/DP groups on it exactly as in a real run and returns that rank's ``Layout``, for which
``model.GPT`` is constructed under ``torch.device("meta")`` (shapes and dtypes, no storage). Ranks of one
TP rank hold the same shapes, so the model is built once per TP rank (as rank ``tp_rank`` of DP rank 0)
and the ZeRO partitions of every DP rank follow DeepSpeed's partitioning (``plan.memory``). The optimizer
is the trainer's own (``optim``'s parameter groups, torch AdamW), stepped once on meta gradients so that
its state exists.

Checked against the planner: every parameter's name and local shape (``shapes.param_inventory``),
the per-rank count, and the Adam moments the optimizer really created.
"""

from __future__ import annotations

import time

import torch

from .. import distributed
from ..config import Config
from ..distributed import LayoutError, check_layout
from .hardware import GIB
from .memory import _ceil_div, _cp, _flat_partition, param_inventory, state_bytes, total_params
from .planner import PlanError, memory_at, planned_config


class DryRunError(RuntimeError):
    """The built model differs from the planner's inventory (a planner bug): the message names it."""


def build_rank(cfg: Config, rank: int, world: int):
    """(model, optimizer) of global ``rank`` on the meta device, built for that rank's layout in a fake
    world (``distributed.init_fake``); the optimizer's state created."""
    from ..model import GPT
    from ..optim import build_optimizer

    layout = distributed.init_fake(rank, world, cfg.parallel.tp)
    try:
        with torch.device("meta"):
            model = GPT(cfg.model, layout, sequence_parallel=cfg.parallel.sp)  # shapes only: no checkpointing
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        optimizer, _ = build_optimizer(model, cfg.train)
        optimizer.step()  # creates exp_avg / exp_avg_sq (meta) and the step counters
    finally:
        distributed.teardown_fake()
    where = {"rank": rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "dp": layout.dp}
    return model, optimizer, where


def _check_against_inventory(cfg: Config, model) -> int:
    expected = [(p.name, p.shape) for p in param_inventory(cfg.model, cfg.parallel.tp)]
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    if built != expected:
        diff = [(e, b) for e, b in zip(expected, built) if e != b][:3]
        raise DryRunError(f"the model's parameters differ from the planner's inventory: {diff} "
                          f"({len(built)} built, {len(expected)} planned)")  # fmt: skip
    return sum(p.numel() for p in model.parameters())


def zero_shard(cfg: Config, model, optimizer, dp: int) -> dict:
    """Elements this rank's ZeRO partition owns, from the built optimizer's groups (DeepSpeed's rules)."""
    stage = cfg.parallel.zero_stage
    groups = [sum(p.numel() for p in g["params"]) for g in optimizer.param_groups]
    sizes = [p.numel() for p in model.parameters()]
    if stage == 0:
        owned = sum(sizes)
    elif stage in (1, 2):
        owned = sum(_flat_partition(n, dp) for n in groups)
    else:
        owned = sum(_ceil_div(n, dp) for n in sizes)
    moments = sum(
        t.numel() for state in optimizer.state.values() for k, t in state.items() if k.startswith("exp_avg")
    )
    return {
        "owned": owned,
        "adam_moments": moments,
        "groups": [g.get("name") for g in optimizer.param_groups],
    }


def rank_rows(cfg: Config, world: int, by_tp: dict, mem: dict) -> list[dict]:
    """Every rank's figures: its TP rank's built shard and its own ZeRO state (ZeRO-2's differ a little)."""
    tp = cfg.parallel.tp
    dp = world // tp
    states = [state_bytes(cfg, dp, rank=r)["total"] for r in range(dp)]
    rows = []
    for rank in range(world):
        tp_rank, dp_rank = rank % tp, rank // tp  # megatron: TP groups are consecutive ranks
        info = by_tp[tp_rank]
        state = states[dp_rank]
        rows.append({"rank": rank, "tp_rank": tp_rank, "dp_rank": dp_rank, "params": info["params"],
                     "zero_owned": info["owned"], "state_bytes": state,
                     "activation_bytes": mem["activations"]["total"],
                     "total_bytes": mem["total"] - mem["state"]["total"] + state})  # fmt: skip
    return rows


def _spans(values: list[int]) -> str:
    """1,2,3,5,7,8 -> '1-3,5,7-8'."""
    out, values = [], sorted(set(values))
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


ROW_FIGURES = ("params", "zero_owned", "state_bytes", "activation_bytes", "total_bytes")


def distinct_rows(ranks: list[dict]) -> list[dict]:
    """Ranks with the same figures, as one row each: which TP and DP ranks, how many, the figures."""
    groups: dict[tuple, list[dict]] = {}
    for r in ranks:
        groups.setdefault(tuple(r[k] for k in ROW_FIGURES), []).append(r)
    rows = []
    for key, members in groups.items():
        tps, dps = _spans([m["tp_rank"] for m in members]), _spans([m["dp_rank"] for m in members])
        rows.append({"ranks": f"tp {tps} x dp {dps}", "count": len(members), **dict(zip(ROW_FIGURES, key))})
    return rows


def materialize(cfg: Config, world: int, log=print) -> dict:
    """Build every TP rank's model and optimizer in a fake ``world``; print per-rank shards and memory."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise PlanError("--materialize needs a process without a torch.distributed world")
    cfg = planned_config(cfg)  # precision and GOAT's lanes as the planner (and a GPU run) resolve them
    m, tp, cp = cfg.model, cfg.parallel.tp, _cp(cfg)
    if cp != 1:
        raise PlanError("--materialize builds TP x DP layouts; parallel.cp > 1 is not built yet")
    try:
        check_layout(world, tp, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len, cfg.parallel.sp)
    except LayoutError as e:
        raise PlanError(str(e)) from None
    dp = world // tp
    t0 = time.perf_counter()
    by_tp: dict[int, dict] = {}
    for tp_rank in range(tp):
        model, optimizer, where = build_rank(cfg, tp_rank, world)  # DP rank 0 of each TP rank
        count = _check_against_inventory(cfg, model)
        shard = zero_shard(cfg, model, optimizer, dp)
        if shard["adam_moments"] != 2 * count:
            raise DryRunError(f"AdamW holds {shard['adam_moments']} moment elements for {count} parameters")
        by_tp[tp_rank] = {"params": count, **shard, "dp": where["dp"]}
        del model, optimizer
    built_s = time.perf_counter() - t0
    mem = memory_at(cfg, dp, cfg.train.micro_batch_size)
    log(f"dry run      {world} ranks = TP {tp} x DP {dp}, ZeRO-{cfg.parallel.zero_stage}, "
        f"{cfg.train.precision}; model and AdamW built on the meta device under a fake process group "
        f"({tp} TP ranks built in {built_s:.1f} s)")  # fmt: skip
    log(f"parameters   {total_params(m):,} in the model (planned); per TP rank as built: "
        + ", ".join(f"{v['params']:,}" for v in by_tp.values())
        + f"; optimizer groups: {', '.join(by_tp[0]['groups'])}")  # fmt: skip
    ranks = rank_rows(cfg, world, by_tp, mem)
    rows = distinct_rows(ranks)
    log(f"{'ranks':<24s} count   params/rank   zero-owned   state GiB  activations GiB  total GiB")
    for row in rows:
        log(f"{row['ranks']:<24s} {row['count']:5d} {row['params']:13,d} {row['zero_owned']:12,d} "
            f"{row['state_bytes'] / GIB:11.3f} {row['activation_bytes'] / GIB:16.3f} "
            f"{row['total_bytes'] / GIB:10.3f}")  # fmt: skip
    return {"world": world, "tp": tp, "dp": dp, "build_seconds": built_s, "ranks": ranks, "rows": rows}
