"""AdamW parameter groups and the learning-rate schedule (warmup, then cosine, linear, constant or
warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def is_prior(name: str) -> bool:
    """GOAT's prior parameters (lambda_*, recency_slope_raw, sink_*, the sink MLP): kept fp32 in bf16 mode."""
    return ".prior." in f".{name}"


def no_decay(name: str, param: nn.Parameter, shape=None) -> bool:
    """Norms, biases and the GOAT prior are not decayed (the prior's scale is its meaning). ``shape``: the
    parameter's shape as the model defines it, where its data lives elsewhere (a ZeRO-3 partition)."""
    return len(param.shape if shape is None else shape) < 2 or is_prior(name) or "norm" in name


def param_groups(model: nn.Module, weight_decay: float, shape_of=None) -> list[dict]:
    """Three groups: decayed weights, undecayed weights, and the GOAT prior (undecayed).

    The prior has a group of its own because each group must hold one dtype: DeepSpeed flattens a group
    into one buffer (ZeRO-1/2) and in bf16 mode the prior stays fp32 while everything else is bf16
    (``engine.patches.keep_fp32_through_cast``). Empty groups are dropped (models without a GOAT prior).
    ``shape_of(p)``: a parameter's shape as the model defines it (a model built partitioned holds
    placeholders: ``engine.zero3.full_shape``); default ``p.shape``."""
    decay, keep, prior = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            shape = None if shape_of is None else shape_of(p)
            (prior if is_prior(name) else keep if no_decay(name, p, shape) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": keep, "weight_decay": 0.0, "name": "no_decay"},
        {"params": prior, "weight_decay": 0.0, "name": "prior"},
    ]
    return [g for g in groups if g["params"]]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warmup to ``lr`` over
    ``warmup_steps``, then ``train.lr_schedule`` down to ``min_lr`` at ``max_steps``:

    * ``cosine``: half a cosine over the whole remainder;
    * ``linear``: a straight line over the remainder;
    * ``constant``: ``lr`` to the end;
    * ``wsd`` (warmup-stable-decay): ``lr`` until the last ``decay_fraction`` of the steps, then down to
      ``min_lr`` in ``decay_shape`` (linear, cosine, or ``sqrt``: ``1 - sqrt(progress)``).

    A function of the step alone: a resume, a layout change or a different data-parallel size gives the
    same rate at the same step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    kind = cfg.lr_schedule
    if kind == "constant":
        return cfg.lr
    start = cfg.warmup_steps
    if kind == "wsd":
        start = max(start, cfg.max_steps - round(cfg.decay_fraction * cfg.max_steps))
        if step < start:
            return cfg.lr
    progress = min((step - start) / max(cfg.max_steps - start, 1), 1.0)
    shape = cfg.decay_shape if kind == "wsd" else kind
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * _decay(shape, progress)


def _decay(shape: str, progress: float) -> float:
    """The fraction of the way from ``min_lr`` to ``lr`` left at ``progress`` in [0, 1] of the decay."""
    if shape == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return 1 - math.sqrt(progress)
    return 1 - progress  # linear


FUSED_DEVICES = ("cpu", "cuda")


def fused_supported(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel takes floating-point tensors on CPU or CUDA (not the meta device of a
    dry run)."""
    return all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, shape_of=None
) -> tuple[torch.optim.Optimizer, object]:
    """torch AdamW (no extension build needed) and a LambdaLR following ``lr_at``.

    AdamW runs torch's fused kernel where it can: one vectorised pass over all tensors instead of a
    Python loop of small ops per parameter (on this project's CPU machines 35x faster for a 67M-parameter
    model, and the difference between 0.2 and 0.5 of the matmul peak for a whole step; bench/mfu_cpu.py);
    on CUDA it is also torch's fastest AdamW. ``shape_of``: as in ``param_groups``."""
    groups = param_groups(model, cfg.weight_decay, shape_of)
    fused = fused_supported([p for g in groups for p in g["params"]])
    opt = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True if fused else None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return opt, sched
