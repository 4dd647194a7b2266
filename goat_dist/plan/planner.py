"""``goat-dist plan``: does a layout fit, what micro-batch is the largest that fits, how fast will it run.

``make_plan(cfg, nodes, gpus_per_node, gpu, fs_gbps)`` returns a plain dict (printed by ``format_plan``,
or as JSON); every number comes from ``plan.memory`` (bytes), ``plan.checkpoint`` (a checkpoint's bytes,
host memory and save time) and ``observe.flops`` (FLOPs) with the formulas of ``docs/planner.md``.
"""

from __future__ import annotations

import copy

from ..config import Config
from ..distributed import check_layout
from ..engine import sizes as engine_sizes
from ..observe.flops import flops_per_token
from ..precision import resolve_precision
from ..rampup import ramp_sizes
from ..shapes import resolve_key_bias_lanes
from .checkpoint import DEFAULT_FS_GBPS, checkpoint_cost
from .hardware import GIB, GPU
from .memory import (
    _bf16_optimizer,
    _cp,
    activation_bytes,
    construction_bytes,
    param_inventory,
    state_bytes,
    total_params,
    transient_bytes,
)

# Memory a rank uses besides the model: CUDA context (~0.5 GiB), NCCL communicators and their buffers,
# cuBLAS/flash workspaces. The caching allocator's fragmentation takes a share of the rest.
RESERVED_BYTES = int(2.0 * GIB)
FRAGMENTATION = 0.05
TIGHT = 0.10  # a plan within 10 % of the budget is called tight
# Fractions of the bf16 peak that large transformer kernels reach: dense GEMMs of h >= 2048 reach 70-80 %
# of peak on A100/H100; flash-attention 2 forward+backward 50-70 % (Dao 2023).
GEMM_EFFICIENCY = 0.7
ATTENTION_EFFICIENCY = 0.5
# Norms, SwiGLU, residual adds, the softmax of the loss: memory-bound. Their time is taken as moving the
# saved activations ELEMENTWISE_TRAFFIC times through HBM (written forward, read and written backward).
ELEMENTWISE_TRAFFIC = 3
ADAM_BYTES_PER_ELEMENT = 36  # AdamW reads p, g, m, v (fp32) and writes p, m, v; DeepSpeed copies p back


class PlanError(ValueError):
    """The layout cannot run at all (sizes do not divide); the message names the numbers."""


def _with(cfg: Config, **train) -> Config:
    """``cfg`` with other ``train`` values, a copy that shares every other section (none is changed)."""
    out = copy.copy(cfg)
    out.train = copy.copy(cfg.train)
    for key, value in train.items():
        setattr(out.train, key, value)
    return out


def planned_config(cfg: Config) -> Config:
    """``cfg`` as the trainer runs it on GPUs, a copy: ``train.precision=auto`` as what it means on CUDA
    (bf16) and ``model.goat.key_bias_lanes=auto`` as that precision's count (``shapes.key_lanes_for``),
    so the plan sizes the q/k projections the run will build."""
    out = copy.deepcopy(cfg)
    out.train.precision = resolve_precision(out.train.precision, "cuda")
    resolve_key_bias_lanes(out.model, out.train.precision)
    return out


def layout_of(cfg: Config, world: int) -> dict:
    m, par = cfg.model, cfg.parallel
    cp = _cp(cfg)
    try:
        # as the trainer checks it (``Trainer.__init__``)
        check_layout(world, par.tp, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len, par.sp, cp=cp)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if world % (par.tp * cp):
        raise PlanError(f"world size {world} is not divisible by tp x cp = {par.tp} x {cp}")
    dp = world // (par.tp * cp)
    per_step = cfg.train.micro_batch_size * dp
    accum = cfg.train.global_batch_size / per_step
    return {"world": world, "tp": par.tp, "cp": cp, "dp": dp, "sp": par.sp, "zero_stage": par.zero_stage,
            "micro_batch": cfg.train.micro_batch_size, "grad_accum": accum,
            "global_batch": cfg.train.global_batch_size}  # fmt: skip


def memory_at(cfg: Config, dp: int, micro: int, state: dict | None = None) -> dict:
    """Per-rank bytes at ``micro`` sequences per micro-batch: state, activations, transient, reserve.
    ``state``: ``state_bytes`` already computed for this layout (the search reuses it across micro-batch
    sizes)."""
    c = _with(cfg, micro_batch_size=micro)
    state = state_bytes(c, dp) if state is None else state
    act = activation_bytes(c, micro)
    transient = transient_bytes(c, dp, micro)
    total = state["total"] + act["total"] + transient["total"] + RESERVED_BYTES
    return {"state": state, "activations": act, "transient": transient, "reserved": RESERVED_BYTES,
            "total": total}  # fmt: skip


def budget(gpu: GPU) -> int:
    return int(gpu.memory_bytes * (1 - FRAGMENTATION))


def construction_at(cfg: Config, dp: int) -> dict:
    """Per-rank bytes while the model is built (``memory.construction_bytes``) plus the reserve: the
    model is built on the GPU, before any activation exists."""
    build = construction_bytes(cfg, dp)
    return {"state": build, "reserved": RESERVED_BYTES, "total": build["total"] + RESERVED_BYTES}


def largest_micro_batch(cfg: Config, dp: int, gpu: GPU, limit: int = 4096) -> int:
    """The largest micro-batch whose memory fits the budget (0: not even one sequence fits, or the
    model cannot be built)."""
    fits = lambda b: memory_at(cfg, dp, b)["total"] <= budget(gpu)
    if construction_at(cfg, dp)["total"] > budget(gpu) or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # memory grows with the micro-batch: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


_FLOPS: dict[str, dict[str, float]] = {}


def _flops_per_token(m) -> dict[str, float]:
    """``observe.flops.flops_per_token`` of the model, kept per model (``plan --search`` asks thousands
    of times)."""
    key = repr(m)
    if key not in _FLOPS:
        if len(_FLOPS) >= 64:
            _FLOPS.clear()
        _FLOPS[key] = flops_per_token(m)
    return dict(_FLOPS[key])


def _ring(bytes_: float, n: int, bandwidth: float, all_reduce: bool, cost: float = 1.0) -> float:
    """Seconds of a ring collective over ``n`` ranks: all-reduce moves 2(n-1)/n of the buffer, an
    all-gather or reduce-scatter (n-1)/n; ``cost``: the device's all-gather or reduce-scatter time over
    that (``GPU.all_gather_cost``, ``reduce_scatter_cost``: 1 for NCCL's rings)."""
    if n <= 1:
        return 0.0
    factor = (2 if all_reduce else cost) * (n - 1) / n
    return factor * bytes_ / bandwidth


def _bucket_s(elements: int, numel: int, nbytes: int, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of one reduce bucket (``elements``, at most the ``numel`` reduced) all-reduced over ``n``
    ranks: the part of a reduction that cannot hide, the last bucket of a backward."""
    if n <= 1:
        return 0.0
    return latency + _ring(min(elements, numel) * nbytes, n, bandwidth, all_reduce=True)


def _calls(numel: int, per_call: int) -> int:
    return -(-numel // max(per_call, 1))


def dp_schedule(
    cfg: Config, layout: dict, gpu: GPU, gpus_per_node: int, forward_s: float, backward_s: float
) -> dict:
    """The data-parallel communication of one step as DeepSpeed 0.19 schedules it per ZeRO stage, with
    what of it hides behind compute (``docs/planner.md``, "What DeepSpeed overlaps"). ``forward_s`` and
    ``backward_s``: the step's compute in the forward and the backward (recomputation included), summed
    over its micro-batches.

    * ZeRO-0 (and DeepSpeed's ``BF16_Optimizer``, bf16 ZeRO-0/1 accumulating in fp32): the engine's
      ``allreduce_gradients`` all-reduces at the accumulation boundary, after the last backward
      (``buffered_allreduce_fallback``, flat buffers of at most ``ZERO0_ALLREDUCE_ELEMENTS``): exposed;
      ZeRO-1's ``BF16_Optimizer`` then all-gathers the updated weights: exposed.
    * ZeRO-1 (``stage_1_and_2``): with ``overlap_comm`` its gradient hooks reduce each full bucket on the
      reduction stream during the boundary micro-batch's backward only (``reduce_ready_partitions_and_
      remove_grads`` reduces when ``is_gradient_accumulation_boundary()``). A bucket is all-reduced whole
      (``average_tensor``: ``use_multi_rank_bucket_allreduce``, DeepSpeed's default; each rank keeps its
      partition's slice), so it moves an all-reduce's bytes, not a reduce-scatter's. Hidden behind that
      backward but its last bucket; the weights' all-gather after the step (one per optimizer group) is
      exposed.
    * ZeRO-2: the same during every micro-batch's backward; the all-gather exposed.
    * ZeRO-3: each micro-batch gathers the weights (those above the persistence threshold, one gather
      each) for its forward and again for its backward, prefetched a bucket ahead
      (``stage3_prefetch_bucket_size``), and reduce-scatters the gradients bucket by bucket during the
      backward: hidden behind the forward and the backward but the first layer's gather of each and the
      last bucket.

    Bytes: gradients in the reduce dtype (``parallel.grad_reduce_dtype``: 4 bytes unless bf16 is chosen),
    weights in the working dtype; buckets of ``engine.sizes.bucket_elements`` (h^2); each collective also
    costs ``GPU.collective_latency_s``. Without streams (``GPU.streams`` false: DeepSpeed's CPU
    accelerator) nothing hides."""
    m, t = cfg.model, cfg.train
    world, tp, dp, cp = layout["world"], layout["tp"], layout["dp"], layout["cp"]
    bf16 = t.precision == "bf16"
    replicas = dp * cp
    inv = param_inventory(m, tp)
    numel = sum(p.numel for p in inv)
    groups = len({p.group for p in inv})
    g = 2 if bf16 and cfg.parallel.grad_reduce_dtype == "bf16" else 4
    w = 2 if bf16 else 4
    link = gpu.nvlink_gb_s if world <= gpus_per_node else gpu.network_gb_s
    bw = link * 1e9 * gpu.link_efficiency
    lat = gpu.collective_latency_s if replicas > 1 else 0.0
    stage = cfg.parallel.zero_stage
    micro_batches = max(t.global_batch_size // max(t.micro_batch_size * dp, 1), 1)
    bucket = engine_sizes.bucket_elements(m.hidden_size)
    last_bucket = _bucket_s(bucket, numel, g, replicas, bw, lat)
    # the updated weights all-gathered once per step, one collective per optimizer group
    ag, rs = gpu.all_gather_cost, gpu.reduce_scatter_cost
    gather = _ring(w * numel, replicas, bw, all_reduce=False, cost=ag) + groups * lat
    fwd, bwd = forward_s / micro_batches, backward_s / micro_batches  # one micro-batch's
    streams = gpu.streams and replicas > 1
    flat_all_reduce = _ring(g * numel, replicas, bw, all_reduce=True)
    flat_all_reduce += _calls(numel, engine_sizes.ZERO0_ALLREDUCE_ELEMENTS) * lat

    def hidden_behind(comm: float, window: float, floor: float) -> float:
        """Exposed seconds of ``comm`` run beside ``window`` of compute, at least ``floor``."""
        return max(min(floor, comm), comm - window) if streams else comm

    if _bf16_optimizer(cfg, replicas):
        schedule = "BF16_Optimizer: fp32 sums all-reduced at the boundary" + (
            ", weights all-gathered" if stage == 1 else ""
        )
        total = exposed = flat_all_reduce + (gather if stage == 1 else 0.0)
    elif stage == 0:
        schedule = "all-reduce at the boundary, after the last backward"
        total = exposed = flat_all_reduce
    elif stage in (1, 2):
        reduce_s = _ring(g * numel, replicas, bw, all_reduce=True) + _calls(numel, bucket) * lat
        reductions = 1 if stage == 1 else micro_batches
        total = reductions * reduce_s + gather
        exposed = reductions * hidden_behind(reduce_s, bwd, last_bucket) + gather
        schedule = (
            "buckets all-reduced during the boundary micro-batch's backward"
            if stage == 1
            else "buckets all-reduced during every backward"
        ) + ", weights all-gathered after the step"
    else:
        persistent = engine_sizes.persistence_threshold(m.hidden_size)
        sizes = [(p.numel, p.name) for p in inv]
        fetched = [(n, name) for n, name in sizes if n > persistent]
        gather_s = _ring(w * sum(n for n, _ in fetched), replicas, bw, False, ag) + len(fetched) * lat
        layer = [n for n, name in fetched if name.startswith("blocks.0.")]
        first = _ring(w * sum(layer), replicas, bw, False, ag) + len(layer) * lat  # not prefetched
        reduce_s = _ring(g * numel, replicas, bw, False, rs) + _calls(numel, bucket) * lat
        total = micro_batches * (2 * gather_s + reduce_s)
        exposed = micro_batches * (
            hidden_behind(gather_s, fwd, first) + hidden_behind(gather_s + reduce_s, bwd, first + last_bucket)
        )
        schedule = "gathers prefetched in forward and backward, buckets reduce-scattered during the backward"
    if not streams and replicas > 1:
        schedule += " (no streams: nothing hides)"
    return {"total_s": total, "exposed_s": exposed, "hidden_s": total - exposed, "schedule": schedule,
            "grad_bytes": g, "bucket_elements": bucket, "numel": numel}  # fmt: skip


def throughput(cfg: Config, layout: dict, gpu: GPU, gpus_per_node: int) -> dict:
    """Estimated step time from FLOPs at assumed kernel efficiencies plus the communication that does not
    hide behind compute (TP and CP's in line with it; DP's as ``dp_schedule`` overlaps it)."""
    m, t = cfg.model, cfg.train
    world, tp, dp, cp = layout["world"], layout["tp"], layout["dp"], layout["cp"]
    bf16 = t.precision == "bf16"
    a = 2 if bf16 else 4
    tokens = t.global_batch_size * m.seq_len
    f = _flops_per_token(m)
    ac = t.activation_checkpointing
    recompute_dense = f["dense"] / 3 if ac == "full" else 0.0
    recompute_attention = f["attention"] / 3 if ac in ("full", "selective") else 0.0
    peak = gpu.peak_bf16
    gemm = (f["dense"] + recompute_dense + f["lm_head"]) * tokens / world
    attention = (f["attention"] + recompute_attention) * tokens / world
    compute_s = gemm / (peak * GEMM_EFFICIENCY) + attention / (peak * ATTENTION_EFFICIENCY)
    # the forward is a third of the 6N FLOPs; the backward is the rest (recomputation included): the
    # windows in which DeepSpeed's overlapped DP communication can hide (``dp_schedule``)
    forward_s = ((f["dense"] + f["lm_head"]) / 3 * tokens / world) / (peak * GEMM_EFFICIENCY) + (
        f["attention"] / 3 * tokens / world
    ) / (peak * ATTENTION_EFFICIENCY)
    backward_s = compute_s - forward_s
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp) or 1
    full = _with(cfg, activation_checkpointing="none")
    moved = activation_bytes(full, t.micro_batch_size)["total"] * ELEMENTWISE_TRAFFIC * micro_batches
    memory_s = moved / (gpu.hbm_tb_s * 1e12)
    nvlink = gpu.nvlink_gb_s * 1e9 * gpu.link_efficiency
    network = gpu.network_gb_s * 1e9 * gpu.link_efficiency
    # TP: 2 all-reduces (or all-gather + reduce-scatter pairs under SP: the same bytes, twice the
    # collectives) of the [s, b, h] activations per layer forward and 2 backward; full checkpointing
    # repeats the forward's two; outside the layers the vocab-parallel embedding's output and the output
    # layer's input gradient, one each.
    tp_bw = nvlink if tp * cp <= gpus_per_node else network
    per_layer = 4 + (2 if ac == "full" else 0)
    act_bytes = t.micro_batch_size * (m.seq_len // cp) * m.hidden_size * a
    tp_ops = m.num_layers * per_layer + 2
    if layout["sp"]:  # an all-gather and a reduce-scatter in place of each all-reduce
        ring = _ring(act_bytes, tp, tp_bw, False, gpu.all_gather_cost)
        ring += _ring(act_bytes, tp, tp_bw, False, gpu.reduce_scatter_cost)
    else:
        ring = _ring(act_bytes, tp, tp_bw, all_reduce=True)
    tp_s = micro_batches * tp_ops * ring
    if tp > 1:
        tp_s += micro_batches * tp_ops * (2 if layout["sp"] else 1) * gpu.collective_latency_s
    # CP (parallel/context.py): K and V all-gathered over the CP group per layer forward, dK and dV
    # reduce-scattered backward; any recomputation of the attention core (full or selective) gathers
    # again. Not overlapped with compute. Ranks of one CP group sit next to their TP peers.
    kv_heads = m.num_kv_heads or m.num_heads
    kv_bytes = t.micro_batch_size * m.seq_len * (kv_heads // tp) * (m.hidden_size // m.num_heads) * a
    cp_bw = nvlink if tp * cp <= gpus_per_node else network
    cp_per_layer = 4 + (2 if ac in ("full", "selective") else 0)
    gathers = m.num_layers * (2 + (2 if ac in ("full", "selective") else 0))  # K and V, each pass
    scatters = m.num_layers * 2  # dK and dV
    cp_s = micro_batches * gathers * _ring(kv_bytes, cp, cp_bw, False, gpu.all_gather_cost)
    cp_s += micro_batches * scatters * _ring(kv_bytes, cp, cp_bw, False, gpu.reduce_scatter_cost)
    if cp > 1:
        cp_s += micro_batches * m.num_layers * cp_per_layer * gpu.collective_latency_s
    # DP: gradients reduced, and ZeRO partitions, over DP x CP (every replica of a TP slice)
    dps = dp_schedule(cfg, layout, gpu, gpus_per_node, forward_s, backward_s)
    replicas = dp * cp
    stage = cfg.parallel.zero_stage
    partition = dps["numel"] / (replicas if stage else 1)
    optimizer_s = ADAM_BYTES_PER_ELEMENT * partition / (gpu.hbm_tb_s * 1e12)
    step_s = compute_s + memory_s + tp_s + cp_s + dps["exposed_s"] + optimizer_s
    model_flops = f["total"] * tokens
    return {
        "flops_per_token": f["total"],
        "tokens_per_step": tokens,
        "compute_s": compute_s,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "memory_bound_s": memory_s,
        "tp_comm_s": tp_s,
        "cp_comm_s": cp_s,
        "dp_comm_s": dps["exposed_s"],  # what does not hide behind compute
        "dp_total_s": dps["total_s"],
        "dp_hidden_s": dps["hidden_s"],
        "dp_schedule": dps["schedule"],
        "optimizer_s": optimizer_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tflops_per_gpu": model_flops / step_s / world / 1e12,
        "mfu": model_flops / (step_s * world * peak),
        "peak_tflops": peak / 1e12,
    }


def make_plan(
    cfg: Config, nodes: int, gpus_per_node: int, gpu: GPU, fs_gbps: float = DEFAULT_FS_GBPS
) -> dict:
    """The plan of ``cfg`` on ``nodes`` x ``gpus_per_node`` GPUs; ``fs_gbps``: the job's aggregate
    file-system write bandwidth (GB/s) for the checkpoint's save time."""
    world = nodes * gpus_per_node
    auto = cfg.train.precision == "auto"
    cfg = planned_config(cfg)  # the planner plans for GPUs: what auto means on CUDA (lanes included)
    layout = layout_of(cfg, world)
    dp = layout["dp"]
    replicas = dp * layout["cp"]  # ZeRO partitions over DP x CP (parallel/parallelize.py)
    mem = memory_at(cfg, replicas, cfg.train.micro_batch_size)
    stages = {}
    for stage in range(4):
        c = copy.deepcopy(cfg)
        c.parallel.zero_stage = stage
        stages[stage] = state_bytes(c, replicas)
    cap = budget(gpu)
    build = construction_at(cfg, replicas)
    headroom = cap - max(mem["total"], build["total"])  # building the model is a peak of its own
    verdict = "fits" if headroom >= TIGHT * cap else "tight" if headroom >= 0 else "does not fit"
    reason = f"the model cannot be built: {construction_line(build)}" if build["total"] > cap else ""
    notes = []
    if layout["grad_accum"] != int(layout["grad_accum"]):
        t = cfg.train
        notes.append(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro-batch {t.micro_batch_size} x DP {dp}; the trainer refuses it"
        )
    t = cfg.train
    if t.batch_rampup:
        sizes = ramp_sizes(t.global_batch_size, t.batch_rampup)
        odd = [s for s in sizes if s % (t.micro_batch_size * dp)]
        notes.append(
            f"train.batch_rampup: {len(sizes) - 1} smaller global batches first ({sizes[0]} to {sizes[-2]} "
            "sequences; memory is per micro-batch and the same, the step time shown is the full batch's)"
            + (f"; {odd} are not divisible by micro-batch x DP: the trainer refuses them" if odd else "")
        )
    backend = cfg.model.attention_backend
    if (cfg.model.position == "alibi" and backend == "sdpa") or backend == "eager":
        notes.append(f"attention_backend={backend} keeps an L x L tensor per head (counted); "
                     "flash-attn (auto on CUDA) keeps none")  # fmt: skip
    if auto:
        notes.append("train.precision=auto is planned as bf16 (what it means on CUDA)")
    return {
        "gpu": gpu.name,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "params": total_params(cfg.model),
        "params_per_rank": sum(p.numel for p in param_inventory(cfg.model, cfg.parallel.tp)),
        "layout": layout,
        "precision": cfg.train.precision,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "memory": mem,
        "construction": build,
        "zero_stages": stages,
        "capacity": gpu.memory_bytes,
        "budget": cap,
        "headroom": headroom,
        "verdict": verdict,
        "verdict_reason": reason,  # why a layout does not fit, where that is not the training's memory
        "largest_micro_batch": largest_micro_batch(cfg, replicas, gpu),
        "throughput": throughput(cfg, layout, gpu, gpus_per_node),
        "checkpoint": checkpoint_cost(cfg, world, gpus_per_node, fs_gbps),
        "notes": notes,
    }


# ---- text --------------------------------------------------------------------------------------------
def construction_line(build: dict) -> str:
    """What the construction peak is made of, in words, with its figure (GiB per GPU)."""
    b, gib = build["state"], lambda n: f"{n / GIB:.2f}"
    if b["whole_shard"]:
        what = f"the whole TP shard in fp32 {gib(b['whole_shard'])}"
    else:
        what = f"built partitioned: partitions {gib(b['partitions'])} + {b['part']} whole in fp32 "
        what += gib(b["whole_part"]) + (f" + its bf16 cast {gib(b['cast'])}" if b["cast"] else "")
    return f"construction peak {gib(build['total'])} GiB per GPU: {what} + reserved {gib(build['reserved'])}"


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_plan(p: dict) -> str:
    lay, mem, th = p["layout"], p["memory"], p["throughput"]
    act, tr = mem["activations"], mem["transient"]
    lines = [
        f"model        {_count(p['params'])} parameters ({p['params']:,}); "
        f"{_count(p['params_per_rank'])} per TP rank",
        f"hardware     {p['nodes']} node(s) x {p['gpus_per_node']} {p['gpu']} = {lay['world']} GPUs, "
        f"{p['capacity'] / GIB:.1f} GiB each",
        f"layout       TP={lay['tp']} CP={lay['cp']} DP={lay['dp']} SP={'on' if lay['sp'] else 'off'} "
        f"ZeRO-{lay['zero_stage']} | {p['precision']} | checkpointing {p['activation_checkpointing']} | "
        f"micro {lay['micro_batch']} x accum {lay['grad_accum']:g} x DP {lay['dp']} "
        f"= global {lay['global_batch']}",
        "",
        "per-GPU memory (ZeRO stage: parameters / gradients / optimizer / buffers = state)",
    ]
    for stage, s in p["zero_stages"].items():
        mark = "  <- configured" if stage == lay["zero_stage"] else ""
        lines.append(f"  ZeRO-{stage}  {_gib(s['params'])} {_gib(s['grads'])} {_gib(s['optimizer'])} "
                     f"{_gib(s['buffers'])} = {_gib(s['total'])}{mark}")  # fmt: skip
    lines += [
        f"  activations     {_gib(act['total'])}  ({act['per_layer'] / GIB:.3f} GiB per layer x "
        f"{act['layers'] // max(act['per_layer'], 1)} layers + {act['outside'] / GIB:.3f} GiB outside; "
        f"micro-batch {lay['micro_batch']}"
        + (f"; of which CP's whole-row K/V {act['cp_kv'] / GIB:.2f} GiB" if act.get("cp_kv") else "")
        + ")",
        f"  transient       {_gib(tr['total'])}  ("
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in tr.items() if k != "total" and v)
        + ")",
        f"  reserved        {_gib(mem['reserved'])}  (CUDA context, NCCL, workspaces)",
        f"  construction    {_gib(p['construction']['total'])}  ({construction_line(p['construction'])}; "
        f"{'can' if p['construction']['total'] <= p['budget'] else 'CANNOT'} be built)",
        f"  total           {_gib(mem['total'])}  of a {_gib(p['budget']).strip()} budget "
        f"({p['capacity'] / GIB:.1f} GiB less 5 % fragmentation)",
        f"verdict      {p['verdict']}: "
        + (f"{p['verdict_reason']}; " if p.get("verdict_reason") else "")
        + f"headroom {p['headroom'] / GIB:.2f} GiB; "
        f"largest micro-batch that fits: {p['largest_micro_batch']}",
        "",
        f"throughput   step {th['step_s']:.3f} s (matmuls {th['compute_s']:.3f}, memory-bound ops "
        f"{th['memory_bound_s']:.3f}, TP comm {th['tp_comm_s']:.3f}, CP comm {th['cp_comm_s']:.3f}, "
        f"DP comm {th['dp_comm_s']:.3f}, optimizer {th['optimizer_s']:.3f})",
        f"             {th['tokens_per_s']:,.0f} tokens/s, {th['tflops_per_gpu']:.0f} TFLOP/s per GPU, "
        f"MFU {th['mfu']:.1%} of {th['peak_tflops']:.0f} TFLOP/s bf16 "
        f"({th['flops_per_token'] / 1e9:.2f} GFLOP per token)",
        "",
        *format_checkpoint(p["checkpoint"]),
    ]
    lines += [f"note         {n}" for n in p["notes"]]
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def format_checkpoint(c: dict) -> list[str]:
    """The checkpoint lines of the plan: size, bytes per rank and node, host memory, save time."""
    return [
        f"checkpoint   {_gb(c['bytes'])} (fp32 masters + Adam moments, 12 B per parameter); written "
        f"{_gb(c['bytes_per_rank'])} per rank, {_gb(c['bytes_per_node'])} per node",
        f"             host memory per node for a save: sync {_gb(c['host_sync_per_node'])} (one tensor at a "
        f"time), async {_gb(c['host_async_per_node'])} (the ranks' shares, pinned)",
        f"             save ~{c['save_s']:.1f} s at {c['fs_gbps']:g} GB/s aggregate file-system write "
        f"bandwidth (--fs-gbps)",
    ]
