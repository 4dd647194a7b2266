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

# ZeRO stages at which a bf16 run with fp32 gradient reduction and more than one micro-batch accumulates
# its gradients in fp32 (``data_types.grad_accum_dtype``): DeepSpeed refuses it without ZeRO and swaps
# ZeRO-1's optimizer for one whose masters ``masters`` does not read (``build.deepspeed_config``)
FP32_ACCUMULATION_STAGES = (2, 3)

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
