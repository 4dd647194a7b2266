"""Where DeepSpeed's behaviour is changed for this project, each with the reason and the test that
watches it (``tests/unit/engine/test_engine_contract.py``: a DeepSpeed upgrade shows which assumption broke).

* ``keep_fp32_through_cast``: bf16 mode casts every parameter; some must stay fp32 (GOAT's prior).
* ``undo_unfused_init_step``: bf16 + ZeRO-0 steps Adam once while it is built; no other stage does.
* ``record_grad_norm``: fp32 ZeRO-0 clips but drops the norm it computed.
* ``mark_tp_gradients``: bf16 + ZeRO-0 + TP counts only TP rank 0's gradient slices in its norm.
* ``skip_shm_build``: the CPU accelerator JIT-compiles an inference-only op on first init.
* ``bf16_optimizer_without_zero``: bf16 + ZeRO-0 + fp32 accumulation, which DeepSpeed refuses.
* ``checked_not_broadcast``: DeepSpeed broadcasts every parameter at start; every replica built the same
  weights already, so one all-reduce of per-tensor fingerprints checks that instead (``check_replicas``).

GOAT's prior in bf16 mode: DeepSpeed's bf16 mode casts every parameter's ``.data``
(``DeepSpeedEngine._cast_module_mixed_precision``), which bypasses ``GoatPrior._apply``, the hook that keeps
the prior fp32 under ``model.to(bfloat16)``. ZeRO-0 (FP16_UnfusedOptimizer: per-parameter fp32 clones) and
ZeRO-1/2 (one flat buffer per parameter group, its own fp32 partition, overflow check and norm per group)
accept a group of fp32 parameters next to bf16 groups, so the prior is excluded from the cast and has its
own group (``optim.param_groups``); its gradients travel in DeepSpeed's bf16 communication buckets
like all others. ZeRO-3 does not: it moves the partitions of all groups into ONE contiguous buffer
(``defragment`` in deepspeed/runtime/zero/utils.py asserts a single dtype; stage3.py
``_create_fp16_partitions_with_defragmentation``). Under ZeRO-3 + bf16 the prior's parameters are
therefore bf16 while their master copy and Adam state stay fp32, and ``zero3.install_fp32_mirror`` hands
the forward pass the fp32 master values (tests/unit/engine/test_bf16_prior.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .sizes import PRIOR_FP32_STAGES  # ZeRO stages whose bf16 mode can keep a group of fp32 parameters

__all__ = [
    "PRIOR_FP32_STAGES",
    "bf16_optimizer_without_zero",
    "check_replicas",
    "checked_not_broadcast",
    "fingerprint",
    "keep_fp32_through_cast",
    "mark_tp_gradients",
    "record_grad_norm",
    "skip_shm_build",
    "undo_unfused_init_step",
]


def skip_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPU inference (~20 s of g++) on first init.
    Training never uses it: mark the op incompatible so it is not built."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def keep_fp32_through_cast(params: list[nn.Parameter]):
    """While DeepSpeed's engine is built, its mixed-precision cast leaves ``params`` as they are.

    The cast replaces each parameter's ``.data``; the original fp32 tensors are put back right after it,
    before DeepSpeed builds its optimizer (which then sees fp32 parameters in the prior's group)."""
    if not params:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._cast_module_mixed_precision

    def cast(engine, *args, **kwargs):
        saved = [(p, p.data) for p in params]
        original(engine, *args, **kwargs)
        for p, data in saved:
            p.data = data

    DeepSpeedEngine._cast_module_mixed_precision = cast
    try:
        yield
    finally:
        DeepSpeedEngine._cast_module_mixed_precision = original


def undo_unfused_init_step(engine) -> None:
    """bf16 + ZeRO-0: undo the optimizer step DeepSpeed takes while building its FP16_UnfusedOptimizer.

    ``initialize_optimizer_states`` steps Adam once with zero gradients so that its state exists. That is
    not free: AdamW's decoupled weight decay shrinks the fp32 masters by lr * weight_decay, and Adam's
    step counter (its bias correction) runs one ahead for the whole run. No other stage does this, so
    bf16 ZeRO-0 trained differently from bf16 ZeRO-1/2 and from fp32 (~6e-3 relative loss after 10
    steps of the test model), and a universal resume between them changed the bias correction. The
    masters are copied again from the model weights, which that step did not touch, and Adam's state
    starts empty like everywhere else (torch creates it at the first real step)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if type(opt) is not FP16_UnfusedOptimizer:
        return
    with torch.no_grad():
        for weights, masters in zip(opt.fp16_groups, opt.fp32_groups):
            for p, master in zip(weights, masters):
                master.copy_(p.data)
    opt.optimizer.state.clear()


def mark_tp_gradients(model: nn.Module) -> int:
    """bf16 + ZeRO-0 + TP: let DeepSpeed's norm see which gradients are tensor-parallel slices.

    DeepSpeed's FP16_UnfusedOptimizer computes the norm with ``get_weight_norm`` on the gradient tensors
    and asks ``is_model_parallel_parameter`` of each of them; a gradient never carries megatron's
    ``tensor_model_parallel`` attribute, so every TP rank but 0 skips all of its gradients and the norm
    (and the clipping based on it) counts TP rank 0's slices only (0.90 of the TP=1 norm for the test
    model at TP=2; tests/integration/parallel/test_scale_out.py). Each new gradient of a TP-split parameter
    gets the
    attribute, so the norm sums every rank's slices and counts replicated parameters (identical on all
    TP ranks) once."""
    count = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.register_post_accumulate_grad_hook(_mark_grad)
            count += 1
    return count


def _mark_grad(p: nn.Parameter) -> None:
    if p.grad is not None:
        p.grad.tensor_model_parallel = True


def record_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed clips the gradients but drops the norm it computed; keep it, so that
    ``engine.get_global_grad_norm()`` (``steps.global_grad_norm``) means the same at every stage."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record():
        engine._global_grad_norm = float(
            clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        )

    engine.clip_fp32_gradients = clip_and_record


@contextlib.contextmanager
def bf16_optimizer_without_zero(enabled: bool):
    """While DeepSpeed's engine is built: bf16 without ZeRO accumulates micro-batches in fp32.

    DeepSpeed refuses bf16 weights with ``grad_accum_dtype: fp32`` outside ZeRO and pipelines
    (``NotImplementedError: unsupported mix``), so ZeRO-0 would sum every micro-batch into the bf16
    ``.grad``. Its answer for ZeRO-1 (and for pipelines at ZeRO-0) is ``BF16_Optimizer``: each micro-batch's
    bf16 gradients are added into a whole fp32 buffer, which the engine all-reduces at the boundary
    (ZeRO-0's own reduction, over the replicas). Here the engine builds that optimizer at ZeRO-0 too, with
    a group of this rank alone as its partition group: the fp32 masters and Adam's moments stay whole on
    every rank, as ZeRO-0 keeps them, and its all-gather of the updated weights is a copy. The group is
    created by this rank alone (``use_local_synchronization``): no collective over the world."""
    if not enabled:
        yield
        return
    import torch.distributed as dist
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.engine import DeepSpeedEngine

    check, configure = DeepSpeedEngine._do_optimizer_sanity_check, DeepSpeedEngine._configure_bf16_optimizer

    def sanity_check(engine, basic_optimizer):
        if engine.zero_optimization() or engine.get_data_types() != (torch.bfloat16, torch.float32):
            return check(engine, basic_optimizer)
        return BFLOAT16

    def bf16_optimizer(engine, optimizer):
        replicas = engine.seq_data_parallel_group
        engine.seq_data_parallel_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        try:
            return configure(engine, optimizer)
        finally:
            engine.seq_data_parallel_group = replicas

    DeepSpeedEngine._do_optimizer_sanity_check = sanity_check
    DeepSpeedEngine._configure_bf16_optimizer = bf16_optimizer
    try:
        yield
    finally:
        DeepSpeedEngine._do_optimizer_sanity_check = check
        DeepSpeedEngine._configure_bf16_optimizer = configure


# ---- no start-up broadcast of the weights ------------------------------------------------------------
# elements widened to int64 at once, with as many int64 weights: 64 MiB on a GPU (few kernels for a
# whole TP slice), 1 MiB on the host, where ZeRO-3's construction peak is the host's (``construct.py``)
FINGERPRINT_CHUNK, FINGERPRINT_CHUNK_HOST = 1 << 22, 1 << 16
_MASK = (1 << 62) - 1  # fingerprints are kept mod 2**62: one more piece's sum (< 2**61) never overflows


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers (on ``t``'s device) that change with any bit of ``t``: the sum of its elements'
    bit patterns and their sum weighted by position (mod 251, + 1), mod 2**62. Integer sums do not
    depend on the order they are added in, so equal tensors give equal fingerprints on any device; a
    piece of ``FINGERPRINT_CHUNK`` elements at a time is widened, never the whole tensor."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    bits = flat.view(torch.int16 if size == 2 else torch.uint8 if size == 1 else torch.int32)
    out = torch.zeros(2, dtype=torch.int64, device=bits.device)
    chunk = FINGERPRINT_CHUNK_HOST if bits.device.type == "cpu" else FINGERPRINT_CHUNK
    for start in range(0, bits.numel(), chunk):
        piece = bits[start : start + chunk].to(torch.int64)  # |bits| < 2**31
        weight = torch.arange(start, start + piece.numel(), dtype=torch.int64, device=bits.device)
        out[0] += piece.sum()
        out[1] += piece.mul_(weight.remainder_(251).add_(1)).sum()  # each sum < 2**(31 + 8 + 22)
        out.bitwise_and_(_MASK)
    return out


def check_replicas(named: list[tuple[str, torch.Tensor]], group) -> None:
    """Collective over ``group`` (the replicas of one TP slice): a RuntimeError on every rank unless every
    rank holds bit-identical ``named`` tensors (the same names in the same order on every rank). One
    all-reduce of 4 int64 per tensor (each rank's fingerprints and their negatives, maximised: equal on
    every rank exactly when the largest and the smallest agree), where DeepSpeed broadcast the tensors."""
    import torch.distributed as dist

    if not named or dist.get_world_size(group) == 1:
        return
    local = torch.stack([fingerprint(t) for _, t in named])
    both = torch.cat([local, -local], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    differ = (both[:, :2] != -both[:, 2:]).any(dim=1).tolist()
    bad = [name for (name, _), d in zip(named, differ) if d]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise RuntimeError(
            f"the initial weights differ between data-parallel replicas of the same TP slice ({len(bad)} of "
            f"{len(named)} tensors: {shown}): every rank must build the same model from the same seed and "
            "config (train.seed, model.*); nothing is broadcast at start to hide a difference"
        )


def _replicated(p) -> bool:
    """What DeepSpeed's ``_broadcast_model`` broadcasts: a parameter not partitioned by ZeRO-3."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if hasattr(p, "ds_status") and p.ds_status is not ZeroParamStatus.AVAILABLE:
        return False
    return not hasattr(p, "ds_optim_param")


@contextlib.contextmanager
def checked_not_broadcast():
    """While DeepSpeed's engine (or ZeRO-3's ``zero.Init``) is built: no parameter is broadcast.

    DeepSpeed makes the replicas of a TP slice agree by broadcasting every parameter from the group's
    first rank: the engine at ZeRO 0-2 (``DeepSpeedEngine._broadcast_model``), ``zero.Init`` before it
    partitions each parameter at ZeRO-3 (``Init._zero_init_param``). Each rank's share of that traffic is
    its whole TP slice (7.5 GB per rank in bf16 for the 30B config at TP=8, whatever the world), for
    weights every rank already built identically (``model.gpt``: every value is drawn from a seed of its
    global position). Here the engine checks instead (``check_replicas``: one all-reduce of fingerprints,
    31 KB for the 30B config's 963 tensors), and ``zero.Init`` partitions without broadcasting (its
    caller checks: ``construct.PartitionAsBuilt``). A model with DeepSpeed MoE layers keeps DeepSpeed's
    broadcast."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    broadcast_model, zero_init_param = DeepSpeedEngine._broadcast_model, Init._zero_init_param

    def check_model(engine):
        if engine.dist_backend is None:
            return None
        if getattr(engine, "has_moe_layers", False):
            return broadcast_model(engine)
        named = [(n, p) for n, p in engine.module.named_parameters() if _replicated(p)]
        return check_replicas(named, engine.seq_data_parallel_group)

    def partition_only(init, param):
        init._convert_to_deepspeed_param(param)
        param.partition()

    DeepSpeedEngine._broadcast_model = check_model
    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = broadcast_model
        Init._zero_init_param = zero_init_param
