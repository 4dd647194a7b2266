"""The analytical communication volume of one training step per rank, by group, beside which the rehearsal
prints what the step really sent.

Bytes are ring bytes (NCCL's bus traffic) sent by one rank per optimizer step: an all-reduce of a buffer of
B bytes over n ranks sends 2(n-1)/n B, an all-gather or reduce-scatter of a whole tensor of B bytes
(n-1)/n B (``world.Collective.wire_bytes`` counts recorded calls the same way).

* TP (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4):
  per layer and micro-batch, two all-reduces of the [s, b, h] activations forward and two backward; under
  sequence parallelism each becomes an all-gather plus a reduce-scatter of the same total volume, and
  Megatron's column-parallel layers gather their input again in the backward for the weight gradient
  (two more all-gathers per layer). Full activation checkpointing repeats the forward's. Outside the
  layers: the embedding's reduction (a reduce-scatter into the sequence-parallel region under SP, an
  all-reduce without), the LM head's input gather under SP (forward all-gather, backward reduce-scatter
  and the weight gradient's gather) or its backward all-reduce without, and the vocab-parallel cross
  entropy's three fp32 all-reduces of [s, b]. Small terms (the one fp32 sum of the replicated gradients
  per backward) are left out. goat_dist's embedding all-reduces under SP, then keeps its slice, where
  Megatron reduce-scatters: twice that term's bytes, which the recorded figure shows (about 8 % of a
  2-block cut's TP bytes, 0.3 % of a 64-layer model's).
* CP (``parallel/context.py``): K and V all-gathered per layer forward, their gradients reduce-scattered
  backward; recomputing the attention core (full or selective checkpointing) gathers again.
* DP (DeepSpeed, per ZeRO stage, over DP x CP, gradients in the reduce dtype, weights in the training
  dtype): ZeRO-0 all-reduces the gradients once per step; ZeRO-1 reduce-scatters them once and
  all-gathers the updated weights; ZeRO-2 reduce-scatters every micro-batch's and all-gathers once;
  ZeRO-3 all-gathers the weights forward and backward and reduce-scatters gradients, every micro-batch.
"""

from __future__ import annotations

from ..config import Config
from ..engine.sizes import uses_bf16_optimizer
from ..shapes import head_dims, param_inventory


def _ring(bytes_: float, n: int, all_reduce: bool) -> float:
    if n <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (n - 1) / n * bytes_


def analytical(cfg: Config, tp: int, cp: int, dp: int, micro_batches: int) -> dict[str, float]:
    """Ring bytes per step per rank by group (``tp``, ``cp``, ``dp``; ``dp`` means DP x CP, ZeRO's group)
    for ``cfg`` (resolved: bf16 or fp32) at this layout."""
    m, t = cfg.model, cfg.train
    a = 2 if t.precision == "bf16" else 4
    sp, ac = cfg.parallel.sp, t.activation_checkpointing
    b, s, h = t.micro_batch_size, m.seq_len // cp, m.hidden_size
    act = b * s * h * a  # one [s, b, h] activation of this rank's tokens
    per_layer = 4 + (2 if ac == "full" else 0)  # all-reduce equivalents
    tp_layer = per_layer * _ring(act, tp, all_reduce=True)
    if sp:
        tp_layer += 2 * _ring(act, tp, all_reduce=False)  # the backward's re-gathered inputs
    if sp:
        # the embedding's reduce-scatter; the LM head's input: gathered forward, its gradient
        # reduce-scattered and the input gathered again for the weight gradient backward
        outside = _ring(act, tp, False) + 3 * _ring(act, tp, False)
    else:
        outside = 2 * _ring(act, tp, True)  # embedding AR; the head input's backward AR
    outside += 3 * _ring(4 * b * s, tp, True)  # cross entropy: max, target logit, sum of exp
    tp_bytes = micro_batches * (m.num_layers * tp_layer + outside)

    heads, kv, head_dim, _ = head_dims(m)
    kv_bytes = b * m.seq_len * (kv // tp) * head_dim * a  # K (or V) of the whole rows, this TP slice
    cp_per_layer = 4 + (2 if ac in ("full", "selective") else 0)
    cp_bytes = micro_batches * m.num_layers * cp_per_layer * _ring(kv_bytes, cp, False)

    replicas = dp * cp
    numel = sum(p.numel for p in param_inventory(m, tp))
    grad = (4 if a == 4 or cfg.parallel.grad_reduce_dtype == "fp32" else 2) * numel
    weight = a * numel
    stage = cfg.parallel.zero_stage
    bf16_optimizer = uses_bf16_optimizer(
        stage, cfg.train.precision, cfg.parallel.grad_accum_dtype, micro_batches, cfg.train.batch_rampup
    )
    if stage == 0:
        dp_bytes = _ring(grad, replicas, True)
    elif bf16_optimizer:  # ZeRO-1's BF16_Optimizer: the fp32 sums all-reduced, the weights all-gathered
        dp_bytes = _ring(grad, replicas, True) + _ring(weight, replicas, False)
    elif stage == 1:
        dp_bytes = _ring(grad, replicas, False) + _ring(weight, replicas, False)
    elif stage == 2:
        dp_bytes = micro_batches * _ring(grad, replicas, False) + _ring(weight, replicas, False)
    else:
        dp_bytes = micro_batches * (2 * _ring(weight, replicas, False) + _ring(grad, replicas, False))
    return {"tp": tp_bytes, "cp": cp_bytes, "dp": dp_bytes}


def recorded(calls, phases=("forward", "backward", "engine", "step")) -> dict[str, float]:
    """Ring bytes per group of recorded calls (``world.Collective``), DP x CP counted as ``dp``."""
    out: dict[str, float] = {}
    for c in calls:
        if c.phase not in phases:
            continue
        group = "dp" if c.group == "replicas" else c.group
        out[group] = out.get(group, 0.0) + c.wire_bytes
    return out
