"""Building the DeepSpeed engine: its configuration, its view of megatron's process groups, and the
patches it needs (``patches.py``) applied where they belong.

The model arrives made of megatron-core tensor-parallel layers with its optimizer and LR schedule built
(``goat_dist/optim.py``); this wraps them in DeepSpeed's engine, ZeRO over the data-parallel x
context-parallel group of the layout (``MegatronMPU``), and returns the engine behind its facade
(``facade.Engine``).
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn

from ..config import Config
from ..distributed import Layout
from . import patches, sizes
from .facade import Engine
from .zero3 import install_fp32_mirror


class MegatronMPU:
    """The model-parallel interface DeepSpeed expects, answered from a ``distributed.Layout`` (megatron's
    groups, handed over by ``distributed.init``).

    DeepSpeed's "data parallel" is every replica of a TP slice: DP x CP. Context-parallel ranks hold
    identical weights (CP splits activations only) and their gradients are partial sums of one loss, so
    gradient averaging and ZeRO's partitions span DP x CP (at CP=1 this is megatron's DP group)."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def get_model_parallel_rank(self) -> int:
        return self.layout.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.layout.tp

    def get_model_parallel_group(self):
        return self.layout.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.layout.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.layout.replicas

    def get_data_parallel_group(self):
        return self.layout.replica_group


def deepspeed_config(cfg: Config, grad_accum: int) -> dict:
    """DeepSpeed's configuration. ZeRO-1/2 reduce gradient buckets while the backward pass goes on
    (``overlap_comm``, which DeepSpeed enables by itself for ZeRO-3 only) into one contiguous buffer
    (``contiguous_gradients``). Communication buckets are sized from the model (as Hugging Face's "auto"
    does) instead of DeepSpeed's fixed 5e8-element defaults, which allocate gigabytes of buffers even
    for a small model.

    Gradient precision under bf16. The reduction (``parallel.grad_reduce_dtype``): DeepSpeed's default
    reduces bf16 gradients in bf16, and the mean's relative error then grows with the data-parallel size
    (0.8 % at DP 64, 13 % at DP 512; ``bench/grad_reduction_error.py``, ``docs/precision.md``); ``fp32``
    (the default, as Megatron does) reduces them in fp32 (``communication_data_type``). The accumulation
    over micro-batches (``parallel.grad_accum_dtype``, ``sizes.accumulates_fp32``): DeepSpeed's default
    sums them in the bf16 ``.grad``; ``fp32`` (the default, as Megatron's ``main_grad``) sets
    ``data_types.grad_accum_dtype: fp32``:

    * ZeRO-2: the rank's reduced gradient partition becomes one fp32 flat buffer into which each
      micro-batch's fp32 reduction is added (no bf16 rounding between micro-batches);
    * ZeRO-3: the flat gradient partition is fp32, and the reduce bucket is in the communication dtype;
    * ZeRO-1: DeepSpeed's ``BF16_Optimizer``: each micro-batch's bf16 gradients are added into a
      whole-model fp32 buffer, all-reduced at the boundary; fp32 masters partitioned over the replicas;
    * ZeRO-0: the same optimizer, its masters kept whole on every rank (DeepSpeed itself refuses bf16
      with fp32 accumulation without ZeRO; ``patches.bf16_optimizer_without_zero``)."""
    h = cfg.model.hidden_size
    bf16 = cfg.train.precision == "bf16"
    reduce_fp32 = cfg.parallel.grad_reduce_dtype == "fp32"
    precision: dict = {"bf16": {"enabled": bf16}}
    if bf16:
        precision["communication_data_type"] = "fp32" if reduce_fp32 else "bf16"
        if sizes.accumulates_fp32(
            cfg.train.precision, cfg.parallel.grad_accum_dtype, grad_accum, cfg.train.batch_rampup
        ):
            precision["data_types"] = {"grad_accum_dtype": "fp32"}
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": sizes.bucket_elements(h),
            "allgather_bucket_size": sizes.bucket_elements(h),
            "stage3_prefetch_bucket_size": sizes.prefetch_elements(h),
            "stage3_param_persistence_threshold": sizes.persistence_threshold(h),
        },
        "zero_allow_untested_optimizer": True,
        **precision,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class HeldGradHooks:
    """The gradient hooks DeepSpeed registers on ``params`` while it builds its engine, held here instead of
    given to torch, for a caller that must change those gradients before the engine reduces them (the TP
    gradient sum, ``parallel.parallelize.TPGradSum``) and then runs them itself (``run``).

    Why: ZeRO-1/2/3 reduce (and ZeRO-3 partitions) each gradient from a hook it registers with
    ``register_post_accumulate_grad_hook`` during ``deepspeed.initialize``
    (``tests/unit/engine/test_engine_contract.py``); a hook the caller registers later would run after
    them, on a
    gradient already reduced. While the engine is built (``capturing``) each parameter's
    ``register_post_accumulate_grad_hook`` is shadowed by one that records the hook and returns a handle
    whose ``remove`` forgets it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = list(params)
        self.hooks: list[list] = [[] for _ in self.params]

    def run(self, i: int) -> None:
        """Run the held hooks of parameter ``i``, in the order they were registered."""
        for hook in self.hooks[i]:
            hook(self.params[i])

    @contextlib.contextmanager
    def capturing(self):
        for i, p in enumerate(self.params):
            # an instance attribute shadows torch's method for these parameters only, and only here
            p.register_post_accumulate_grad_hook = functools.partial(self._hold, i)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            for p in self.params:
                del p.register_post_accumulate_grad_hook

    def _hold(self, i: int, hook) -> _HeldHandle:
        self.hooks[i].append(hook)
        return _HeldHandle(self.hooks[i], hook)


class _HeldHandle:
    """What ``register_post_accumulate_grad_hook`` returns, for a held hook."""

    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def build_engine(
    model: nn.Module,
    layout: Layout,
    cfg: Config,
    grad_accum: int,
    *,
    optimizer,
    scheduler,
    fp32_params: list[nn.Parameter] = (),
    fp32_attr: str = "",
    held_hooks: HeldGradHooks | None = None,
) -> Engine:
    """The engine (``facade.Engine``) wrapping ``model`` (which it moves to the right device),
    ``optimizer`` and ``scheduler`` in DeepSpeed's, over ``layout``'s groups (ZeRO over its replicas).

    ``fp32_params``: parameters whose forward must compute from fp32 values in bf16 mode (GOAT's prior):
    kept fp32 through the cast at ZeRO 0-2; at ZeRO-3 their fp32 masters are mirrored into
    ``getattr(p, fp32_attr)`` before each forward (``zero3.install_fp32_mirror``).
    ``held_hooks``: the engine's gradient hooks on ``held_hooks.params`` are held there for its owner to
    run (``HeldGradHooks``)."""
    import deepspeed

    patches.skip_shm_build()
    bf16, stage = cfg.train.precision == "bf16", cfg.parallel.zero_stage
    fp32_params = list(fp32_params)
    keep = fp32_params if bf16 and stage in patches.PRIOR_FP32_STAGES else []
    capturing = held_hooks.capturing() if held_hooks is not None else contextlib.nullcontext()
    p = cfg.parallel
    fp32_sum = stage == 0 and sizes.uses_bf16_optimizer(
        stage, cfg.train.precision, p.grad_accum_dtype, grad_accum, cfg.train.batch_rampup
    )
    with (
        patches.keep_fp32_through_cast(keep),
        patches.bf16_optimizer_without_zero(fp32_sum),
        patches.checked_not_broadcast(),  # no start-up broadcast of the weights: a check that they agree
        capturing,
    ):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg, grad_accum),
            mpu=MegatronMPU(layout),
            dist_init_required=False,
        )
    if bf16 and stage not in patches.PRIOR_FP32_STAGES and fp32_params:
        install_fp32_mirror(engine, fp32_params, fp32_attr)
    if stage == 0 and not bf16:
        patches.record_grad_norm(engine)
    if stage == 0 and bf16 and not fp32_sum:
        patches.undo_unfused_init_step(engine)
        if layout.tp > 1:
            patches.mark_tp_gradients(model)
    return Engine(engine)
