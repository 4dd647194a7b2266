"""AdamW parameter groups and the learning-rate schedule (warmup, then cosine, linear, constant or
warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig
from .config.sections import PRIOR_WEIGHT_DECAY


def is_prior(name: str) -> bool:
    """GOAT's prior parameters (lambda_*, recency_slope_raw, sink_*, the sink MLP): kept fp32 in bf16 mode."""
    return ".prior." in f".{name}"


def no_decay(name: str, param: nn.Parameter, shape=None) -> bool:
    """Norms, biases and the GOAT prior are not decayed (the prior's scale is its meaning). ``shape``: the
    parameter's shape as the model defines it, where its data lives elsewhere (a ZeRO-3 partition)."""
    return len(param.shape if shape is None else shape) < 2 or is_prior(name) or "norm" in name


# The prior parameters the authors' C4 script decays (see ``decays``), by our attribute names
C4_DECAYED_PRIOR = ("sink_gain", "sink_bump", "recency_slope_raw")
# (prior?, decayed?) -> optimizer group name, in the order the groups are built
GROUP_OF = {
    (False, True): "decay",
    (False, False): "no_decay",
    (True, False): "prior",
    (True, True): "prior_decay",
}
DECAYED_GROUPS = tuple(group for (_, decayed), group in GROUP_OF.items() if decayed)


def decays(name: str, param: nn.Parameter, prior_weight_decay: str = "none", shape=None) -> bool:
    """Whether AdamW decays parameter ``name`` under ``train.prior_weight_decay``.

    * ``none`` (default): the paper's "no weight decay on prior parameters"; matrices decay, norms,
      biases and every prior parameter do not (``no_decay``).
    * ``c4``: the authors' ``train_c4.py``, which decays every parameter whose name lacks ``.bias``,
      ``ln``, ``norm``, ``lambda_`` and ``key_bias``. Their names mapped to ours (``goat.attention``
      0.1.1 vs ``goat/prior.py``; the rest of the model is decayed alike, ours by shape, theirs by name):

      ==============================  ==========================================  =========
      reference (theirs)              goat-dist (ours, ``blocks.N.attn.prior.``)  decayed
      ==============================  ==========================================  =========
      ``lambda_sym``, ``lambda_asym`` ``lambda_sym``, ``lambda_asym`` (a, b)      no
      ``key_bias.fc{1,2}.weight``     ``sink_mlp.fc{1,2}.weight``                 no
      ``key_bias.fc{1,2}.bias``       ``sink_mlp.fc{1,2}.bias``                   no
      ``sink_gain``                   ``sink_gain``                               **yes**
      ``sink_bump``                   ``sink_bump``                               **yes**
      ``recency_slope_raw``           ``recency_slope_raw``                       **yes**
      ``prior_gate_*``                (none: no prior gate)                       (unused)
      ``in_proj``/``out_proj.weight`` ``attn.qkv``/``attn.proj.weight``           yes
      ``*.bias``, ``ln*``, ``*norm*`` biases, ``*_norm.*``, ``final_norm.*``      no
      ==============================  ==========================================  =========

      So ``c4`` = ``none`` plus ``C4_DECAYED_PRIOR``. Why it matters: decay pulls the raw values to 0,
      i.e. the sink gain toward 0 (the sink MLP off), the token-0 bump toward 0, and the recency slope
      toward softplus(0) = ln 2 = 0.69 (12 heads start at ALiBi's 0.0039 .. 0.71: all but one are flatter).
    * ``all``: every parameter, norms, biases and the whole prior included, as the authors'
      passkey/NIAH script does (there at ``weight_decay`` 0.01).
    """
    if prior_weight_decay == "all":
        return True
    if is_prior(name):
        return prior_weight_decay == "c4" and name.rsplit(".", 1)[-1] in C4_DECAYED_PRIOR
    return not no_decay(name, param, shape)


def param_groups(
    model: nn.Module, weight_decay: float, shape_of=None, prior_weight_decay: str = "none"
) -> list[dict]:
    """AdamW's groups: ``decay`` and ``no_decay`` (the model's weights), ``prior`` and ``prior_decay``
    (GOAT's), each decayed at ``weight_decay`` or not as its name says; which parameter decays is
    ``decays`` under ``prior_weight_decay`` (``train.prior_weight_decay``).

    The prior has groups of its own because each group must hold one dtype: DeepSpeed flattens a group
    into one buffer (ZeRO-1/2) and in bf16 mode the prior stays fp32 while everything else is bf16
    (``engine.patches.keep_fp32_through_cast``, which keeps the prior's parameters by name, whatever
    group they are in). Weight decay is a group setting, so a prior that partly decays (``c4``) takes two
    fp32 groups. Empty groups are dropped: the default gives ``decay``, ``no_decay``, ``prior`` as
    before (and no prior group without a GOAT prior); ``c4`` adds ``prior_decay``; ``all`` gives
    ``decay`` and ``prior_decay``. The group names are recorded in a checkpoint's layout, so a resume
    that changes the setting is reported as a layout change (the state loads by parameter name, as on
    any layout change).
    ``shape_of(p)``: a parameter's shape as the model defines it (a model built partitioned holds
    placeholders: ``engine.zero3.full_shape``); default ``p.shape``."""
    if prior_weight_decay not in PRIOR_WEIGHT_DECAY:
        raise ValueError(
            f"prior_weight_decay must be one of {PRIOR_WEIGHT_DECAY}, got {prior_weight_decay!r}"
        )
    members: dict[str, list] = {group: [] for group in GROUP_OF.values()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            shape = None if shape_of is None else shape_of(p)
            decay = decays(name, p, prior_weight_decay, shape)
            members[GROUP_OF[is_prior(name), decay]].append(p)
    return [
        {"params": params, "weight_decay": weight_decay if group in DECAYED_GROUPS else 0.0, "name": group}
        for group, params in members.items()
        if params
    ]


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
    groups = param_groups(model, cfg.weight_decay, shape_of, cfg.prior_weight_decay)
    fused = fused_supported([p for g in groups for p in g["params"]])
    opt = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True if fused else None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return opt, sched
