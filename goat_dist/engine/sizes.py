"""The engine's sizes and stage rules that the memory planner counts with, in one place.

Why here: ``build.deepspeed_config`` sets DeepSpeed's buffers from these and the planner
(``goat_dist.plan.memory``) counts their bytes from the config alone, before any engine exists; one
definition keeps the two from drifting (``tests/unit/engine/test_engine_contract.py`` checks the values
DeepSpeed
fixes itself). Nothing is imported: the planner reads these without torch or DeepSpeed.
"""

from __future__ import annotations

# ZeRO stages whose bf16 mode can keep a group of fp32 parameters (GOAT's prior); ZeRO-3 keeps every
# partition in one buffer of one dtype, so there the prior is bf16 and mirrored from its fp32 masters
# (``patches``, ``zero3.install_fp32_mirror``)
PRIOR_FP32_STAGES = (0, 1, 2)

# ZeRO stages at which a bf16 run accumulating in fp32 runs DeepSpeed's ``BF16_Optimizer``: a whole-model
# fp32 gradient buffer into which each micro-batch's bf16 gradients are added, all-reduced at the
# accumulation boundary; fp32 masters partitioned over the replicas at ZeRO-1, kept whole on every rank at
# ZeRO-0 (``patches.bf16_optimizer_without_zero``)
BF16_OPTIMIZER_STAGES = (0, 1)


def accumulates_fp32(precision: str, grad_accum_dtype: str, micro_batches: int, rampup) -> bool:
    """Whether a run sums its micro-batch gradients in fp32 (``parallel.grad_accum_dtype``): fp32 runs
    always do; a bf16 run does with ``grad_accum_dtype=fp32`` once there is anything to accumulate (more
    than one micro-batch per step, or a batch ramp-up, whose later steps have more: the optimizer is
    chosen once, when the engine is built)."""
    if precision != "bf16":
        return True
    return grad_accum_dtype == "fp32" and (micro_batches > 1 or bool(rampup))


def uses_bf16_optimizer(
    stage: int, precision: str, grad_accum_dtype: str, micro_batches: int, rampup
) -> bool:
    """Whether the engine's optimizer is DeepSpeed's ``BF16_Optimizer`` (``BF16_OPTIMIZER_STAGES``)."""
    return (
        precision == "bf16"
        and stage in BF16_OPTIMIZER_STAGES
        and accumulates_fp32(precision, grad_accum_dtype, micro_batches, rampup)
    )


# Without ZeRO, DeepSpeed all-reduces the gradients at the accumulation boundary through flat buckets of
# at most this many elements (its ``MEMORY_OPT_ALLREDUCE_SIZE``, not configurable through the config)
ZERO0_ALLREDUCE_ELEMENTS = 500_000_000


def bucket_elements(hidden_size: int) -> int:
    """Reduce and all-gather bucket elements: h^2, sized from the model (as Hugging Face's "auto" does)
    instead of DeepSpeed's fixed 5e8-element defaults, which allocate gigabytes for a small model."""
    return hidden_size**2


def prefetch_elements(hidden_size: int) -> int:
    """ZeRO-3's parameter prefetch bucket: 0.9 of a bucket."""
    return int(0.9 * bucket_elements(hidden_size))


def persistence_threshold(hidden_size: int) -> int:
    """ZeRO-3 keeps parameters of at most this many elements whole on every rank (norms, biases)."""
    return 10 * hidden_size
