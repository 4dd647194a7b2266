"""The one step that turns a model into a distributed training engine.

The model is already made of megatron-core tensor-parallel layers; this adds what spans ranks: gradient
reductions for parameters replicated across the TP group, and DeepSpeed's engine (ZeRO over the
data-parallel group only, through megatron's process groups).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from ..config import Config
from .optim import build_optimizer


class MegatronMPU:
    """The model-parallel interface DeepSpeed expects, answered by megatron-core's parallel_state."""

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)


def tp_partial_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient on one TP rank covers only that rank's share of the work:
    norms under sequence parallelism (a slice of the sequence) and GOAT's shared sink MLP (a slice of
    the heads). Their gradients must be summed over the TP group."""
    params = []
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) or ".prior.sink_mlp." in name:
            params.append(p)
    return params


def add_tp_grad_allreduce(model: nn.Module) -> int:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return 0
    group = parallel_state.get_tensor_model_parallel_group()

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    params = tp_partial_grad_params(model)
    for p in params:
        p.register_hook(all_reduce)
    return len(params)


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPU inference (~20 s of g++) on first init.
    Training never uses it: mark the op incompatible so it is not built."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(cfg: Config, grad_accum: int) -> dict:
    # Communication buckets sized from the model (as Hugging Face's "auto" does) instead of DeepSpeed's
    # fixed 5e8-element defaults, which allocate gigabytes of buffers even for a small model.
    h2 = cfg.model.hidden_size**2
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
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
    add_tp_grad_allreduce(model)
    optimizer, scheduler = build_optimizer(model, cfg.train)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, grad_accum),
        mpu=MegatronMPU(),
        dist_init_required=False,
    )
    if cfg.parallel.zero_stage == 0:
        _record_grad_norm(engine)
    return engine


def _record_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed clips the gradients but drops the norm it computed; keep it, so that
    ``engine.get_global_grad_norm()`` means the same at every stage."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record():
        engine._global_grad_norm = float(
            clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        )

    engine.clip_fp32_gradients = clip_and_record
