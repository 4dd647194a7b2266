"""Per-rank memory of a training run, from the config alone: parameters, gradients, optimizer state
(per ZeRO stage, as the engine stores them) and activations (per micro-batch, as this model saves them).

Every term is documented, with its derivation, in ``docs/planner.md``; the parameter inventory is checked
name by name against the real model (``goat-dist plan --materialize``,
``tests/integration/plan/test_plan*.py``)
and the byte counts against real engines and saved-tensor hooks on CPU, and against one rank's training
step traced on fake tensors (``rehearsal.memory``; ``tests/unit/plan/test_rehearsal_memory.py``).
"""

from __future__ import annotations

import bisect

from ..config import Config, ModelConfig
from ..engine import sizes as engine_sizes
from ..engine.sizes import ZERO0_ALLREDUCE_ELEMENTS, accumulates_fp32, uses_bf16_optimizer
from ..shapes import (
    SINK_HIDDEN,
    ParamSpec,
    ffn_size,
    head_dims,
    padded_vocab_size,
    qkv_width,
    total_params,
)
from ..shapes import param_inventory as _model_inventory

# the parameter inventory lives in ``goat_dist.shapes``; these names stay importable from here
__all__ = [
    "ParamSpec",
    "activation_bytes",
    "construction_bytes",
    "model_parts",
    "param_inventory",
    "partition_overlap",
    "state_bytes",
    "total_params",
    "transient_bytes",
    "zero_options",
]


_INVENTORIES: dict[tuple[str, int], list[ParamSpec]] = {}


def param_inventory(cfg: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """``shapes.param_inventory``, kept per model and TP size (``plan --search`` asks for the same
    inventory thousands of times); a new list of the same frozen specs on every call."""
    key = (repr(cfg), tp)
    if key not in _INVENTORIES:
        if len(_INVENTORIES) >= 64:
            _INVENTORIES.clear()
        _INVENTORIES[key] = _model_inventory(cfg, tp)
    return list(_INVENTORIES[key])


# ---- parameters, gradients, optimizer state ----------------------------------------------------------
# The engine's options that size its buffers, from the sizes ``engine.build.deepspeed_config`` sets them
# with (``goat_dist.engine.sizes``; a test compares the two): reduce/all-gather buckets of h^2 elements,
# contiguous gradients and overlapped communication on at every stage (overlap double-buffers the ZeRO-1/2
# reduce bucket; ZeRO-0 has none). ZeRO-0 all-reduces gradients at the boundary through flat buckets of
# at most ``ZERO0_ALLREDUCE_ELEMENTS`` (the engine's fixed all-reduce size).


def zero_options(cfg: Config) -> dict:
    """The ZeRO settings the byte counts below assume for ``cfg`` (the same at every stage)."""
    return {
        "reduce_bucket_size": engine_sizes.bucket_elements(cfg.model.hidden_size),
        "overlap_comm": True,
        "contiguous_gradients": True,
    }


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _flat_partition(numel: int, dp: int) -> int:
    """ZeRO-1/2: a group is flattened, padded to a multiple of ``dp`` (and of 2 elements, the engine's
    NCCL alignment) and split into ``dp`` equal partitions."""
    return _ceil_div(numel, 2 * dp) * 2


def _groups(inv: list[ParamSpec]) -> dict[str, list[int]]:
    """Parameter sizes per optimizer group, in the order ZeRO flattens them (the model's order)."""
    groups: dict[str, list[int]] = {}
    for p in inv:
        groups.setdefault(p.group, []).append(p.numel)
    return groups


def partition_overlap(sizes: list[int], dp: int) -> list[int]:
    """Per ZeRO-1/2 rank: elements of the whole parameters that touch its partition of a group.

    ZeRO keeps a rank's gradient partition as the gradients of every parameter that overlaps its
    range, whole (the partition's gradient buffer is sized by those parameters' full element counts), so
    a rank whose range cuts a large parameter (the embedding) holds all of it."""
    return [sum(sizes[i] for i in touched) for touched in _touching(sizes, dp)]


NORM_CHUNK = (
    1 << 22
)  # observe.step_metrics.NORM_CHUNK: the parameter norm's fp32 piece (a test holds them equal)


def _reduce_bytes(cfg: Config) -> int:
    """Bytes per gradient element on the wire (``parallel.grad_reduce_dtype``; fp32 runs reduce in fp32)."""
    return 2 if cfg.train.precision == "bf16" and cfg.parallel.grad_reduce_dtype == "bf16" else 4


def _fp32_accumulation(cfg: Config, replicas: int) -> bool:
    """Whether a bf16 run's engine sums its micro-batch gradients in fp32 (``parallel.grad_accum_dtype``,
    ``engine.sizes.accumulates_fp32``), at ``replicas`` = DP x CP."""
    t = cfg.train
    return t.precision == "bf16" and accumulates_fp32(
        t.precision, cfg.parallel.grad_accum_dtype, _grad_accumulation(cfg, replicas), t.batch_rampup
    )


def _bf16_optimizer(cfg: Config, replicas: int) -> bool:
    """Whether the engine's optimizer is DeepSpeed's ``BF16_Optimizer`` (ZeRO-0/1 accumulating in fp32)."""
    t = cfg.train
    return uses_bf16_optimizer(
        cfg.parallel.zero_stage,
        t.precision,
        cfg.parallel.grad_accum_dtype,
        _grad_accumulation(cfg, replicas),
        t.batch_rampup,
    )


def _touching(sizes: list[int], dp: int) -> list[range]:
    """Per ZeRO-1/2 rank: the indices of a group's parameters that touch its partition (the parameters
    ``partition_overlap`` sums)."""
    part = _flat_partition(sum(sizes), dp)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    out = []
    for r in range(dp):
        first = max(bisect.bisect_right(starts, r * part) - 1, 0)
        last = min(bisect.bisect_left(starts, (r + 1) * part) - 1, len(sizes) - 1)
        out.append(range(first, last + 1) if first < len(sizes) and last >= first else range(0))
    return out


def _grad_bytes_per_element(cfg: Config, group: str, replicas: int = 1) -> int:
    """Gradient bytes of a group: the working dtype, except GOAT's prior, fp32 under bf16 at ZeRO 0-2, and
    every group's under fp32 accumulation (``_fp32_accumulation``, at ``replicas`` = DP x CP)."""
    bf16 = cfg.train.precision == "bf16"
    if group == "prior" and bf16 and cfg.parallel.zero_stage in engine_sizes.PRIOR_FP32_STAGES:
        return 4
    if _fp32_accumulation(cfg, replicas):
        return 4
    return 2 if bf16 else 4


def _grad_accumulation(cfg: Config, replicas: int) -> int:
    """Micro-batches per step: ``replicas`` is DP x CP; the batch is split over DP only."""
    dp = max(replicas // _cp(cfg), 1)
    return max(cfg.train.global_batch_size // max(cfg.train.micro_batch_size * dp, 1), 1)


def state_bytes(cfg: Config, dp: int, rank: int | None = None) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients, optimizer state and the engine's buffers at their peak
    during gradient accumulation, as the engine keeps them with torch AdamW (``dp``: the replicas of a TP
    slice, DP x CP). ``rank``: that replica's figures (ZeRO-2's partitions differ a little); None: the
    busiest replica.

    ``bf16``: 2-byte working weights and gradients, fp32 master weights, fp32 Adam moments (the engine's
    bf16 mode); GOAT's prior keeps fp32 working weights under ZeRO 0-2. ``fp32``: no master copy at ZeRO-0
    (the optimizer steps the parameters), a flat fp32 copy per partition at ZeRO 1-3 (the engine clones it).

    Gradients, read from the engine's ZeRO-1/2 source and measured mid-accumulation:
    ZeRO-1 keeps every parameter's whole ``.grad`` until the accumulation boundary (it reduces only there)
    plus its reduce bucket; ZeRO-2 reduces during each backward and keeps the accumulated partition
    (the whole parameters touching its range) while the next micro-batch's
    reduced copy fills next to it, and a parameter larger than the bucket waits
    whole for its reduction; ZeRO-3 keeps a flat gradient partition, and at the end of a backward the
    largest parameter is gathered whole with its whole gradient.
    """
    m, stage = cfg.model, cfg.parallel.zero_stage
    bf16 = cfg.train.precision == "bf16"
    w = 2 if bf16 else 4  # working weight / gradient bytes
    inv = param_inventory(m, cfg.parallel.tp)
    n = sum(p.numel for p in inv)
    prior = sum(p.numel for p in inv if p.group == "prior")
    # the prior's fp32 working copy (engine/patches.py); under ZeRO-3 + bf16, its gathered fp32 values
    kept_fp32 = stage in engine_sizes.PRIOR_FP32_STAGES
    prior_extra = (4 - w) * prior if kept_fp32 else (4 * prior if bf16 else 0)  # (engine/zero3.py)
    groups = _groups(inv)
    opts = zero_options(cfg)
    bucket_elements = opts["reduce_bucket_size"]
    # ZeRO-1/2 stage gradients in their bucket in the working dtype; ZeRO-3's bucket is in the reduce dtype
    bucket_bytes = _reduce_bytes(cfg) if stage == 3 else w
    bucket = bucket_elements * bucket_bytes * (2 if opts["overlap_comm"] and stage in (1, 2) else 1)
    largest = max(p.numel for p in inv)
    if _bf16_optimizer(cfg, dp):
        # BF16_Optimizer: each group flat in bf16 (aligned to 2 x the partitions), the micro-batch's bf16
        # .grad next to the whole fp32 sum, fp32 masters and moments of the rank's partition (ZeRO-1) or
        # of everything (ZeRO-0: a partition group of one); its boundary all-reduce is a transient
        parts = dp if stage == 1 else 1
        flat = sum(_ceil_div(sum(sizes), 2 * parts) * 2 * parts for sizes in groups.values())
        params = w * flat + prior_extra
        grads = w * n + prior_extra + 4 * flat
        optimizer = 12 * (flat // parts) + 4 * len(groups)
        buffers = 0
    elif stage == 0:
        params = w * n + prior_extra
        grads = params
        optimizer = (4 * n if bf16 else 0) + 8 * n + 4 * len(inv)  # + torch AdamW's per-tensor `step`
        buffers = 0
    elif stage in (1, 2):
        part = sum(_flat_partition(sum(sizes), dp) for sizes in groups.values())
        params = w * sum(_flat_partition(sum(sizes), dp) * dp for sizes in groups.values()) + prior_extra
        # fp32 master partition + two fp32 moments; one `step` per flat group
        optimizer = 12 * part + 4 * len(groups)
        if stage == 1:
            grads = w * n + prior_extra  # every parameter's whole gradient, until the boundary
            buffers = bucket
        elif _fp32_accumulation(cfg, dp):
            # one fp32 flat buffer of the partition, into which each micro-batch's reduction is added; a
            # parameter larger than the bucket is reduced in its own bf16 .grad, which, when it touches the
            # partition, lives until the end of the backward (nothing copies it out), next to the one waiting
            grads = _grad_bytes_per_element(cfg, "", dp) * part
            touching = {g: _touching(sizes, dp) for g, sizes in groups.items()}
            last = next((g, i) for g, sizes in groups.items() for i, n in enumerate(sizes) if n == largest)

            def kept(r: int) -> int:
                big = {(g, i) for g in groups for i in touching[g][r] if groups[g][i] > bucket_elements}
                big |= {last} if largest > bucket_elements else set()
                return w * sum(groups[g][i] for g, i in big)

            buffers = bucket + max(kept(r) for r in ([rank] if rank is not None else range(dp)))
        else:
            held = {g: partition_overlap(sizes, dp) for g, sizes in groups.items()}
            ranks = [rank] if rank is not None else range(dp)
            grads = max(sum(_grad_bytes_per_element(cfg, g, dp) * held[g][r] for g in groups) for r in ranks)
            copies = 1 if _grad_accumulation(cfg, dp) > 1 else 0  # the micro-batch's copy next to the sum
            waiting = w * largest if largest > bucket_elements else 0
            buffers = bucket + copies * grads + waiting
    else:
        persistent = engine_sizes.persistence_threshold(m.hidden_size)  # smaller ones are kept whole
        part = sum(_ceil_div(p.numel, dp) for p in inv)  # every parameter partitioned on its own
        kept = sum(p.numel for p in inv if p.numel <= persistent)  # small ones also kept whole
        params = w * (part + kept) + prior_extra
        grads = _grad_bytes_per_element(cfg, "", dp) * part  # the flat partition, in the accumulation dtype
        optimizer = 12 * part + 4 * len(groups)
        gathered = 2 * w * largest if largest > persistent else 0  # weight + gradient, whole
        buffers = bucket + gathered
    total = params + grads + optimizer + buffers
    return {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers, "total": total}


def transient_bytes(cfg: Config, dp: int, micro_batch: int) -> dict[str, int]:
    """Peaks on top of the state and the saved activations (not part of the validated state):

    * ``zero3_gather``: ZeRO-3 all-gathers a layer's weights for its backward, with their gradients as
      they are produced, and prefetches the next (0.9 h^2 elements);
    * ``allreduce``: ZeRO-0 all-reduces the gradients at the boundary through a flat copy of at most
      ``ZERO0_ALLREDUCE_ELEMENTS`` (and its fp32 cast when bf16 gradients are reduced in fp32);
    * ``fp32_grads``: the masters' gradients at the step, unless the partition was accumulated in fp32
      already: bf16 mode casts every gradient to fp32 at ZeRO-0 and the flat partition at ZeRO-3; at ZeRO
      1-2 DeepSpeed first flattens the partition's gradients into a new tensor (in their dtype, in either
      precision), which bf16 then casts to fp32 next to it (``stage_1_and_2.py``'s ``step``);
    * ``logits``: the LM head's logits next to the fp32 ones the loss keeps: the fp32 copy that masks the
      padded vocabulary columns (``model.gpt.vocab_parallel_logits``; also the masked gradient in the
      backward), else the bf16 logits cast to fp32;
    * ``tied_input``: meanwhile a tied output layer in bf16 holds its fp32 input (the final norm's output:
      CUDA's autocast runs the norms in fp32), whole (gathered under SP), next to the bf16 copy it keeps;
    * ``recompute``: full activation checkpointing rebuilds one layer's activations during its backward;
    * ``params_norm``: a log step's parameter norm (``observe.step_metrics.sumsq``) copies at most
      ``NORM_CHUNK`` elements of one parameter at a time to fp32 and squares them in place: one fp32
      piece of the largest local tensor (its ZeRO-3 partition at stage 3), at most 16 MiB.
    """
    m, stage = cfg.model, cfg.parallel.zero_stage
    bf16 = cfg.train.precision == "bf16"
    w = 2 if bf16 else 4
    tp = cfg.parallel.tp
    inv = param_inventory(m, tp)
    n = sum(p.numel for p in inv)
    layer = sum(p.numel for p in inv if p.name.startswith("blocks.0."))
    out = {"zero3_gather": 0, "allreduce": 0, "fp32_grads": 0, "logits": 0, "tied_input": 0, "recompute": 0,
           "params_norm": 0}  # fmt: skip
    if stage == 3:
        out["zero3_gather"] = w * (2 * layer + engine_sizes.prefetch_elements(m.hidden_size))
    if _bf16_optimizer(cfg, dp) and dp > 1:
        # BF16_Optimizer's fp32 sums all-reduced through a flat copy (and its bf16 cast under a bf16 wire)
        cast = 2 if _reduce_bytes(cfg) == 2 else 0
        out["allreduce"] = (4 + cast) * min(n, ZERO0_ALLREDUCE_ELEMENTS)
    elif stage == 0 and dp > 1:
        # an fp32 reduction (parallel.grad_reduce_dtype) of bf16 gradients casts the flat copy to fp32 too
        cast = 4 if bf16 and _reduce_bytes(cfg) == 4 else 0
        out["allreduce"] = (w + cast) * min(n, ZERO0_ALLREDUCE_ELEMENTS)
    if not _fp32_accumulation(cfg, dp):  # fp32-accumulated partitions are the masters' gradients
        if stage in (1, 2):  # the flattened partition, and its fp32 cast in bf16
            out["fp32_grads"] = (w + (4 if bf16 else 0)) * _ceil_div(n, dp)
        elif bf16:
            out["fp32_grads"] = 4 * (n if stage == 0 else _ceil_div(n, dp))
    padded = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple, tp)
    logits_bytes = 4 if padded != m.vocab_size else (2 if bf16 else 0)
    tokens = micro_batch * _seq_per_rank(cfg)
    out["logits"] = logits_bytes * tokens * (padded // tp)
    if m.tie_embeddings and bf16:
        out["tied_input"] = 4 * tokens * m.hidden_size
    if cfg.train.activation_checkpointing == "full":
        out["recompute"] = activation_bytes(cfg, micro_batch, recompute_layer=True)["per_layer"]
    largest = max((p.numel for p in inv), default=0)
    out["params_norm"] = 4 * min(NORM_CHUNK, _ceil_div(largest, dp) if stage == 3 else largest)
    out["total"] = sum(out.values())
    return out


# ---- construction ------------------------------------------------------------------------------------
def model_parts(inv: list[ParamSpec]) -> dict[str, list[ParamSpec]]:
    """The parts ``model.GPT`` builds one after another (its ``built`` hook): the embedding, the learned
    positions, every block, the final norm, the output layer; in module order."""
    parts: dict[str, list[ParamSpec]] = {}
    for p in inv:
        head = p.name.split(".")
        parts.setdefault(".".join(head[:2]) if head[0] == "blocks" else head[0], []).append(p)
    return parts


def construction_bytes(cfg: Config, dp: int) -> dict:
    """Per-rank peak while the model is built, before the engine exists (``dp``: DP x CP).

    The model's layers are built in fp32. At ZeRO 0-2 a rank builds its whole TP shard: 4Ψ
    (``whole_shard``). At ZeRO-3 each part is built whole, cast to the engine's dtype and partitioned
    before the next one is built (``engine/construct.py``): every partition, ``w Σ⌈ψ_i/N⌉``
    (``partitions``), plus the largest part whole in fp32 (``whole_part``) plus, in bf16, the bf16 copy of
    that part's largest tensor while it is cast (``cast``). ``part``: the name of that part."""
    inv = param_inventory(cfg.model, cfg.parallel.tp)
    out = {"whole_shard": 0, "partitions": 0, "whole_part": 0, "cast": 0}
    if cfg.parallel.zero_stage != 3:
        out["whole_shard"] = 4 * sum(p.numel for p in inv)
        out["total"] = out["whole_shard"]
        return out
    w = 2 if cfg.train.precision == "bf16" else 4
    name, part = max(model_parts(inv).items(), key=lambda kv: sum(p.numel for p in kv[1]))
    out["partitions"] = w * sum(_ceil_div(p.numel, dp) for p in inv)
    out["whole_part"] = 4 * sum(p.numel for p in part)
    out["cast"] = 2 * max(p.numel for p in part) if w == 2 else 0
    out["total"] = out["partitions"] + out["whole_part"] + out["cast"]
    out["part"] = name
    return out


# ---- activations ---------------------------------------------------------------------------------------
def _cp(cfg: Config) -> int:
    """Context-parallel size when the config has one (``parallel.cp``), else 1."""
    return int(getattr(cfg.parallel, "cp", 1) or 1)


def _seq_per_rank(cfg: Config) -> int:
    return cfg.model.seq_len // _cp(cfg)


def activation_bytes(cfg: Config, micro_batch: int, recompute_layer: bool = False) -> dict[str, int]:
    """Bytes saved for backward during one forward pass of ``micro_batch`` sequences on one rank.

    Korthikanti et al. (2022), eq. 1-5, redone for this model as it runs (pre-norm, no dropout masks,
    SwiGLU/GELU, GQA, GOAT lanes, a flash-style kernel that keeps no L x L matrix). Per layer and token,
    in elements (``a`` bytes each: 2 in bf16, 4 in fp32; fp32 terms stay 4 bytes), with t = TP and the
    sequence-parallel split ``t_sp`` = t under SP, else 1:

    * two RMSNorms: input and normalised input, in fp32 (torch's RMSNorm upcasts), ``2h / t_sp`` each, plus
      the fp32 rstd; LayerNorm: input (in fp32) and mean/rstd;
    * inputs of the q/k/v projection and of fc1: ``h / t_sp`` each (megatron keeps the un-gathered input),
      the norms' outputs: fp32 under bf16, since CUDA's autocast runs both norms in fp32;
    * the q/k/v projection's output ``W / t`` (kept alive because v is a view of it);
    * the kernel's q and k (content + prior lanes): ``(H + H_kv) D / t``; its output ``H D / t`` (also the
      projection's input); its log-sum-exp ``H / t`` (fp32);
    * SwiGLU: fc1's output ``2f / t``, silu(gate) ``f / t``, fc2's input ``f / t``; GELU: ``2f / t``;
    * GOAT: the per-position Fourier features and sink-MLP activations, fp32 and not split:
      ``2R + (2M + 2) + 4 + 4 + 1 + 1`` elements and a 1-byte BOS mask; RoPE: cos and sin, ``2D`` fp32.

    Context parallelism (c = ``parallel.cp`` > 1) divides every token count by c, and the kernel keeps the
    K and V of the whole rows, all-gathered over the CP group: ``2 c H_kv D / t`` per local token in place
    of the local k and the projection output (``parallel/context.py``; a flash kernel keeps views of the
    gathered tensors).

    Outside the layers: the final norm, the LM head's input (untied: the final norm's output; tied:
    autocast's bf16 copy of it, gathered to the whole sequence), the vocab-parallel softmax ``V / t`` in
    fp32 and the token/label ids; under sequence parallelism, megatron's all-gather buffer
    (``sp_buffer``): its column-parallel layers gather their input, the whole sequence ``h`` wide, into one
    buffer per dtype (``GlobalMemoryBuffer``, "mpu", the norms' output dtype) that lives from the first
    forward on (a tied output layer gathers into a tensor of its own). Under full checkpointing a layer
    keeps only its input ``h / t_sp``; selective checkpointing drops the kernel's q, k, output and lse and
    the lanes (and CP's gathered K/V) but keeps the projection output (the checkpoint's input) and the
    output.
    """
    m, tp = cfg.model, cfg.parallel.tp
    sp = cfg.parallel.sp
    bf16 = cfg.train.precision == "bf16"
    a = 2 if bf16 else 4
    tsp = tp if sp else 1
    tokens = micro_batch * _seq_per_rank(cfg)
    h = m.hidden_size
    heads, kv, head_dim, _ = head_dims(m)
    ffn = ffn_size(m)
    ac = cfg.train.activation_checkpointing
    if m.norm == "rmsnorm":  # one norm; a layer has two
        norm = 4 * (2 * h / tsp + 1 / tsp)
    else:
        norm = 4 * (h / tsp + 2 / tsp)
    # CUDA's autocast runs rms_norm and layer_norm in fp32 (its fp32 op list): under bf16 the norm's output,
    # the next linear's saved input, is fp32 (CPU autocast leaves both norms in their input's dtype)
    norm_out = 4 if bf16 else a
    linear_in = norm_out * 2 * h / tsp
    qkv_out = a * qkv_width(m) / tp
    kernel = a * (heads + kv) * head_dim / tp + 4 * heads / tp
    kernel_out = a * heads * head_dim / tp
    cp = _cp(cfg)
    gathered_kv = 2 * a * cp * kv * head_dim / tp if cp > 1 else 0.0
    if cp > 1:
        # the kernel keeps this rank's q and the whole rows' K and V, all-gathered (parallel/context.py):
        # cp x the local tokens' K/V; the q/k/v projection's output is no longer kept (v is gathered)
        kernel = a * heads * head_dim / tp + gathered_kv + 4 * heads / tp
        qkv_kept = 0.0
    else:
        qkv_kept = qkv_out
    mlp = a * (4 * ffn if m.activation == "swiglu" else 2 * ffn) / tp
    lanes = 0.0
    if m.position == "goat":
        g = m.goat
        lanes = 4 * 2 * g.pos_rank
        if g.key_bias:
            sink_mlp = (2 * g.abs_rank + 2) + 2 * SINK_HIDDEN + 1 if g.abs_rank > 0 else 0
            lanes += 4 * (sink_mlp + 1) + 1
    elif m.position == "rope":
        lanes = 4 * 2 * head_dim
    quadratic = 0.0
    if (m.position == "alibi" and m.attention_backend == "sdpa") or m.attention_backend == "eager":
        # an explicit (B, H, L, L) bias (ALiBi through SDPA) or fp32 logits (eager). ``auto`` plans for a
        # GPU, where it means flash-attn: no L x L tensor for any scheme (flash computes ALiBi itself).
        quadratic = 4 * heads / tp * _seq_per_rank(cfg) * (1 if m.attention_backend != "eager" else 2)
    full_layer = 2 * norm + linear_in + qkv_kept + kernel + kernel_out + mlp + lanes + quadratic
    if ac == "full" and not recompute_layer:
        layer = a * h / tsp
    elif ac == "selective" and not recompute_layer:
        layer = 2 * norm + linear_in + qkv_out + kernel_out + mlp  # the checkpoint keeps its q/k/v input
    else:
        layer = full_layer
    vocab = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple, tp)
    # untied: the output layer keeps the final norm's output; tied: autocast's bf16 copy, the whole sequence
    head_in = norm_out * h / tsp if not m.tie_embeddings else a * h
    final = norm + head_in + 4 * vocab / tp
    ids = 8 + 8 + 2 + (8 if ac != "none" else 0)  # token ids, targets, two masks; checkpointed: positions
    per_layer = int(layer * tokens)
    sp_buffer = int(norm_out * h * tokens) if sp else 0  # megatron's SP all-gather buffer, kept
    outside = int((final + ids) * tokens + vocab / tp) + sp_buffer  # + the vocabulary slice's padding mask
    total = m.num_layers * per_layer + outside
    kept_kv = ac == "none" or recompute_layer  # checkpointing the attention core recomputes the gather
    cp_kv = int(gathered_kv * tokens) * m.num_layers if kept_kv else 0
    return {"per_layer": per_layer, "layers": m.num_layers * per_layer, "outside": outside,
            "cp_kv": cp_kv, "sp_buffer": sp_buffer, "total": total}  # fmt: skip
