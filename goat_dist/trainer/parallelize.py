"""The one step that turns a model into a distributed training engine.

The model is already made of megatron-core tensor-parallel layers; this adds what spans ranks: gradient
reductions for parameters replicated across the TP group, and DeepSpeed's engine (ZeRO over the
data-parallel x context-parallel group, through megatron's process groups; see MegatronMPU).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from ..config import Config
from . import zero3_prior
from .optim import build_optimizer, is_prior


def _replica_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def _replica_world_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _replica_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


class MegatronMPU:
    """The model-parallel interface DeepSpeed expects, answered by megatron-core's parallel_state.

    DeepSpeed's "data parallel" is every replica of a TP slice: DP x CP. Context-parallel ranks hold
    identical weights (CP splits activations only) and their gradients are partial sums of one loss, so
    gradient averaging and ZeRO's partitions span DP x CP (at CP=1 this is megatron's DP group)."""

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(_replica_rank)
    get_data_parallel_world_size = staticmethod(_replica_world_size)
    get_data_parallel_group = staticmethod(_replica_group)


def tp_partial_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient on one TP rank covers only that rank's share of the work:
    norms under sequence parallelism (a slice of the sequence) and GOAT's shared sink MLP (a slice of
    the heads). Their gradients must be summed over the TP group."""
    params = []
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) or ".prior.sink_mlp." in name:
            params.append(p)
    return params


class TPGradSum:
    """The TP-group sum of ``tp_partial_grad_params``' gradients: ONE flat all-reduce per backward, not
    one small collective per parameter (2 norms per layer under SP, 4 sink-MLP tensors per GOAT layer).

    A tensor hook stashes each such parameter's incoming gradient and lets zeros be accumulated in its
    place; once all of them have arrived (or, for any that get none, when the backward ends), one fp32
    all-reduce sums the stash and each sum is added to its ``.grad``. Only then run the gradient hooks
    that DeepSpeed registered on these parameters (held back by ``defer_hooks`` while the engine is
    built): ZeRO's reductions see the summed gradients, as they did with a hook per parameter."""

    def __init__(self, params: list[nn.Parameter], group):
        self.params, self.group = params, group
        self.deferred: list[list] = [[] for _ in params]
        self.all_reduces = 0  # collectives made so far (one per backward)
        self._reset()
        for i, p in enumerate(params):
            p.register_hook(functools.partial(self._capture, i))
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _reset(self) -> None:
        self.stash: list[torch.Tensor | None] = [None] * len(self.params)
        self.arrived, self.queued = 0, False

    def _capture(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        if not self.queued:  # a parameter without a gradient this backward must not hold the others back
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        self.stash[i] = grad
        return torch.zeros_like(grad)

    def _accumulated(self, p: nn.Parameter) -> None:
        self.arrived += 1
        if self.arrived == len(self.params):
            self.flush()

    def flush(self) -> None:
        """Sum the stashed gradients over TP, add them to ``.grad``, run the deferred hooks."""
        ready = [i for i, g in enumerate(self.stash) if g is not None]
        if ready:
            flat = torch.cat([self.stash[i].reshape(-1).float() for i in ready])
            dist.all_reduce(flat, group=self.group)
            self.all_reduces += 1
            for i, part in zip(ready, flat.split([self.stash[i].numel() for i in ready])):
                grad = self.params[i].grad
                grad.add_(part.view_as(grad).to(grad.dtype))
        self._reset()
        for i in ready:
            for hook in self.deferred[i]:
                hook(self.params[i])

    @contextlib.contextmanager
    def defer_hooks(self):
        """Post-accumulate-grad hooks registered on these parameters meanwhile run after the TP sum."""
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook = functools.partial(self._defer, i)
        try:
            yield
        finally:
            for p in self.params:
                del p.register_post_accumulate_grad_hook

    def _defer(self, i: int, hook) -> _DeferredHandle:
        self.deferred[i].append(hook)
        return _DeferredHandle(self.deferred[i], hook)


class _DeferredHandle:
    """What ``register_post_accumulate_grad_hook`` returns, for a deferred hook."""

    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def add_tp_grad_allreduce(model: nn.Module) -> TPGradSum | None:
    """The TP sum of the partial gradients (``TPGradSum``), or None at TP=1 or without such parameters."""
    params = tp_partial_grad_params(model)
    if parallel_state.get_tensor_model_parallel_world_size() == 1 or not params:
        return None
    return TPGradSum(params, parallel_state.get_tensor_model_parallel_group())


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPU inference (~20 s of g++) on first init.
    Training never uses it: mark the op incompatible so it is not built."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(cfg: Config, grad_accum: int) -> dict:
    """DeepSpeed's configuration. ZeRO-1/2 reduce gradient buckets while the backward pass goes on
    (``overlap_comm``, which DeepSpeed enables by itself for ZeRO-3 only) into one contiguous buffer
    (``contiguous_gradients``). Communication buckets are sized from the model (as Hugging Face's "auto"
    does) instead of DeepSpeed's fixed 5e8-element defaults, which allocate gigabytes of buffers even
    for a small model."""
    h2 = cfg.model.hidden_size**2
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h2,
            "allgather_bucket_size": h2,
            "stage3_prefetch_bucket_size": int(0.9 * h2),
            "stage3_param_persistence_threshold": 10 * cfg.model.hidden_size,
        },
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.train.precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def parallelize(model: nn.Module, cfg: Config, grad_accum: int):
    """Returns the DeepSpeed engine wrapping ``model`` (which it moves to the right device)."""
    import deepspeed

    _skip_deepspeed_shm_build()
    tp_sum = add_tp_grad_allreduce(model)
    optimizer, scheduler = build_optimizer(model, cfg.train)
    bf16, stage = cfg.train.precision == "bf16", cfg.parallel.zero_stage
    keep = prior_params(model) if bf16 and stage in PRIOR_FP32_STAGES else []
    deferred = tp_sum.defer_hooks() if tp_sum is not None else contextlib.nullcontext()
    with keep_fp32_through_cast(keep), deferred:
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg, grad_accum),
            mpu=MegatronMPU(),
            dist_init_required=False,
        )
    if bf16 and stage not in PRIOR_FP32_STAGES and prior_params(model):
        zero3_prior.install(engine, prior_params(model))
    if stage == 0 and not bf16:
        _record_grad_norm(engine)
    if stage == 0 and bf16:
        undo_unfused_init_step(engine)
    if stage == 0 and bf16 and parallel_state.get_tensor_model_parallel_world_size() > 1:
        mark_tp_gradients(model)
    return engine


# ---- GOAT's prior in bf16 mode -------------------------------------------------------------------------
# DeepSpeed's bf16 mode casts every parameter's ``.data`` (DeepSpeedEngine._cast_module_mixed_precision),
# which bypasses GoatPrior._apply, the hook that keeps the prior fp32 under ``model.to(bfloat16)``.
# ZeRO-0 (FP16_UnfusedOptimizer: per-parameter fp32 clones) and ZeRO-1/2 (one flat buffer per parameter
# group, its own fp32 partition, overflow check and norm per group) accept a group of fp32 parameters next
# to bf16 groups, so the prior is excluded from the cast and has its own group (optim.param_groups); its
# gradients travel in DeepSpeed's bf16 communication buckets like all others. ZeRO-3 does not: it moves the
# partitions of all groups into ONE contiguous buffer (``defragment`` in deepspeed/runtime/zero/utils.py
# asserts a single dtype; stage3.py ``_create_fp16_partitions_with_defragmentation``). Under ZeRO-3 + bf16
# the prior's parameters are therefore bf16 while their master copy and Adam state stay fp32, and
# ``zero3_prior.py`` hands the forward pass the fp32 master values (tests/test_bf16_prior.py).
PRIOR_FP32_STAGES = (0, 1, 2)


def prior_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_prior(name)]


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


# ---- gradient norms ------------------------------------------------------------------------------------
def mark_tp_gradients(model: nn.Module) -> int:
    """bf16 + ZeRO-0 + TP: let DeepSpeed's norm see which gradients are tensor-parallel slices.

    DeepSpeed's FP16_UnfusedOptimizer computes the norm with ``get_weight_norm`` on the gradient tensors
    and asks ``is_model_parallel_parameter`` of each of them; a gradient never carries megatron's
    ``tensor_model_parallel`` attribute, so every TP rank but 0 skips all of its gradients and the norm
    (and the clipping based on it) counts TP rank 0's slices only (0.90 of the TP=1 norm for the test
    model at TP=2; tests/test_scale_out.py). Each new
    gradient of a TP-split parameter gets the attribute, so the norm sums every rank's slices and counts
    replicated parameters (identical on all TP ranks) once."""
    count = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.register_post_accumulate_grad_hook(_mark_grad)
            count += 1
    return count


def _mark_grad(p: nn.Parameter) -> None:
    if p.grad is not None:
        p.grad.tensor_model_parallel = True


def _record_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed clips the gradients but drops the norm it computed; keep it, so that
    ``engine.get_global_grad_norm()`` means the same at every stage."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record():
        engine._global_grad_norm = float(
            clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        )

    engine.clip_fp32_gradients = clip_and_record
